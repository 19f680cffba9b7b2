"""The reasoning of reasoning models read out of their chat output, as it streams (vLLM's
`--reasoning-parser`, by name).

Reasoning models (DeepSeek-R1 and its distills, QwQ, Qwen3, ...) think between `<think>` and
`</think>` before they answer. With a reasoning parser, a chat message carries that thinking in
`reasoning` (vLLM's current name) and `reasoning_content` (its older name, which DeepSeek's API and
many clients read), both with the same text, and `content` holds only the answer; a stream's deltas
carry the same fields in pieces. /v1/completions is never parsed (vLLM's rule).

A parser is fed the text of one sequence a piece at a time (`feed`) and told when it ends
(`finish`); it returns events in output order: ("reasoning", text) and ("content", text). A tag
split across pieces is held back until it is known, so the pieces joined are what the whole text
gives at once (`split`), wherever the text was split.

Parsers (current vLLM's rules, vllm/reasoning/deepseek_r1_reasoning_parser.py, qwen3_reasoning_parser.py):
* deepseek_r1: the output starts inside the thinking (the chat template may have opened `<think>` in
  the prompt); an opening `<think>` at its start (after blanks only) is dropped; everything up to
  the first `</think>` is reasoning, everything after it content. Output without `</think>` (cut by
  max_tokens, or a model that never closed it) is all reasoning.
* qwen3: the same (Qwen3's own templates let the model write `<think>`; Qwen3.5's and the 2507
  thinking models' open it in the prompt), plus an implicit end: a `<tool_call>` before any
  `</think>` ends the reasoning, the tag going to the content (Qwen3.5 may call a tool from inside
  its thinking). With `chat_template_kwargs: {"enable_thinking": false}` the template closes the
  thinking in the prompt and the whole output is content.
* glm45 (GLM-4.5 / 4.6; current vLLM reads it with DeepSeekV3ReasoningWithThinkingParser): deepseek_r1's
  rules, output without `</think>` all reasoning; thinking is on unless chat_template_kwargs give
  `enable_thinking` or `thinking` and neither is true (GLM's template then closes `<think></think>` in
  the prompt): the whole output is content. (vLLM's older glm4_moe_reasoning_parser read output without
  both tags as content; its current one does not.)
* deepseek_v3 (DeepSeek-V3.1 and later; vLLM's DeepSeekV3ReasoningParser): thinking is off unless
  chat_template_kwargs give `thinking` (V3.1's switch) or `enable_thinking` true; then the template opens
  `<think>` in the prompt and deepseek_r1's rules apply, else the whole output is content.
* minimax_m2 (MiniMax-M2, M2.1; vLLM's MiniMaxM2ReasoningParser): the template opens `<think>` in the prompt, so
  everything up to the first `</think>` is reasoning (a `<think>` in the output too: nothing is dropped before it),
  everything after it content, with every later `</think>` taken out of it (vLLM's: the model may write it again).
  Output without `</think>` is all reasoning.
* minimax_m2_append_think (vLLM's MiniMaxM2AppendThinkReasoningParser): no reasoning apart: the whole output is
  content, `<think>` put before it (the tag the prompt opened), so the thinking stays in the content as MiniMax
  asks clients to send it back. (Structured output is still refused as for the others: vLLM starts it after
  `</think>`.)
* kimi_k2 (Kimi-K2-Thinking, K2 Instruct; vLLM's KimiK2ReasoningParser): deepseek_r1's rules, plus an implicit end as
  qwen3's: a tool call section (`<|tool_calls_section_begin|>`, or the singular `<|tool_call_section_begin|>`) before
  any `</think>` ends the reasoning, the tag going to the content. Thinking is on unless chat_template_kwargs give
  `thinking` false (Kimi's switch): then the whole output is content.
* seed_oss (Seed-OSS; vLLM's SeedOssReasoningParser): deepseek_r1's rules with Seed's tags, `<seed:think>` and
  `</seed:think>` (the thinking budget's `<seed:cot_budget_reflect>` notes stay in the reasoning).
* ernie45 (ERNIE-4.5-21B-A3B-Thinking; vLLM's Ernie45ReasoningParser): deepseek_r1's rules; the answer, written
  `</think>\n\n<response>\nANSWER\n</response>\n`, is unwrapped: a `<response>` after blanks only opens it (the blanks
  and the tag go), and its last `</response>` and what follows go. (vLLM's whole reply unwraps only where both tags
  are there, from a `<response>` anywhere; its stream unwraps as here.)
* granite (Granite 3.2 / 3.3 with chat_template_kwargs {"thinking": true}; vLLM's GraniteReasoningParser): output
  that starts (after blanks) with "Here is my thought process:" (or "Here's ...") is reasoning up to "Here is my
  response:" (or "Here's ..."), content after it; the phrases go. Output that starts otherwise is all content.
  Output cut before the response phrase is all reasoning (vLLM's stream; its whole reply reads it as content).
* mistral (Magistral; vLLM's MistralReasoningParser): `[THINK]` opens the reasoning and `[/THINK]` ends it; the text
  before `[THINK]` and after `[/THINK]` is content, and output without `[THINK]` is all content, its first `[/THINK]`
  dropped. A `[THINK]` never closed: reasoning to the end. (Both tags are special tokens: with this parser chat
  requests keep special tokens in the text, as for --tool-call-parser mistral.)
* openai_gptoss: gpt-oss's harmony messages, the analysis channel the reasoning, the final channel the
  content (runtime/server/harmony.py: one parser reads the whole output, tool calls too with
  --tool-call-parser openai).
Where vLLM's non-streamed and streamed paths differ, the parser keeps one rule for both: a
`<think>` after reasoning text is text (vLLM's non-streamed reply drops whatever came before it),
and a `<tool_call>` before a later `</think>` ends the qwen3 reasoning (as vLLM's stream does).

Tool calls (`--enable-auto-tool-choice`) are read from the content only: the content events go on
through the tool parser (`with_reasoning`). Structured output cannot start where the reasoning
ends in llmc (vLLM's default): `check_request` refuses it unless the server constrains the whole
output, reasoning included (vLLM's `--structured-outputs-config '{"enable_in_reasoning": true}'`).
"""

from __future__ import annotations

from typing import Any

REASONING_PARSERS = ("deepseek_r1", "qwen3", "glm45", "deepseek_v3", "minimax_m2", "minimax_m2_append_think",
                     "openai_gptoss", "kimi_k2", "seed_oss", "ernie45", "granite", "mistral")
# the chat_template_kwargs that switch thinking off, named in 400s
_THINKING_OFF = {"qwen3": '{"enable_thinking": false}', "glm45": '{"enable_thinking": false}',
                 "deepseek_v3": '{"thinking": false}', "kimi_k2": '{"thinking": false}'}
THINK_START, THINK_END, TOOL_CALL_START = "<think>", "</think>", "<tool_call>"
KIMI_SECTIONS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
SEED_THINK_START, SEED_THINK_END = "<seed:think>", "</seed:think>"
GRANITE_STARTS = ("Here is my thought process:", "Here's my thought process:")
GRANITE_ENDS = ("Here is my response:", "Here's my response:")
RESPONSE_START, RESPONSE_END = "<response>", "</response>"
MISTRAL_THINK, MISTRAL_THINK_END = "[THINK]", "[/THINK]"

Event = tuple  # ("reasoning", str) | ("content", str) | a tool parser's events


def _held_suffix(text: str, tags: tuple[str, ...]) -> int:
    """How many characters at the end of `text` might begin one of `tags` (held until the next piece)."""
    for size in range(min(max(len(t) for t in tags) - 1, len(text)), 0, -1):
        if any(t.startswith(text[-size:]) for t in tags):
            return size
    return 0


class ReasoningParser:
    """The thinking of one sequence's text. `end_tags`: the tags that end the reasoning, with
    whether the tag itself is content (`<tool_call>`) or dropped (`</think>`). `thinking`: False when
    the whole output is content (qwen3 or glm45 with thinking switched off). `starts`: the opening tags, dropped
    at the start (after blanks); without one there the output is reasoning, or content if `required`."""

    def __init__(self, end_tags: dict[str, bool], thinking: bool = True, starts: tuple[str, ...] = (THINK_START,),
                 required: bool = False):
        self.end_tags = end_tags
        self.starts, self.required = starts, required
        self._state = "lead" if thinking else "content"  # lead (only blanks so far), reasoning, content
        self._buffer = ""

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        out: list[Event] = []
        if self._state == "lead":
            stripped = self._buffer.lstrip()
            start = next((tag for tag in self.starts if stripped.startswith(tag)), None)
            if start is not None:  # the model opened the thinking itself: the tag goes
                self._buffer = stripped[len(start):]
                self._state = "reasoning"
            elif any(tag.startswith(stripped) for tag in self.starts):  # blanks, or maybe the tag: wait for more
                return out
            else:
                self._state = "content" if self.required else "reasoning"
        if self._state == "reasoning":
            out += self._reasoning()
        if self._state == "content" and self._buffer:
            out.append(("content", self._buffer))
            self._buffer = ""
        return out

    def _reasoning(self) -> list[Event]:
        found = [(self._buffer.find(tag), tag) for tag in self.end_tags]
        found = [(at, tag) for at, tag in found if at >= 0]
        if not found:
            keep = _held_suffix(self._buffer, tuple(self.end_tags))
            text, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
            return [("reasoning", text)] if text else []
        at, tag = min(found)
        text = self._buffer[:at]
        self._buffer = self._buffer[at:] if self.end_tags[tag] else self._buffer[at + len(tag):]
        self._state = "content"
        return [("reasoning", text)] if text else []

    def finish(self) -> list[Event]:
        """The end of the output: what was held back (blanks, a tag never completed) is what it was in."""
        text, self._buffer = self._buffer, ""
        if not text:
            return []
        content = self._state == "content" or self._state == "lead" and self.required
        return [("content" if content else "reasoning", text)]


class Ernie45ReasoningParser(ReasoningParser):
    """ernie45: deepseek_r1's reasoning, the answer unwrapped from `<response>` ... (its last) `</response>`."""

    def __init__(self):
        super().__init__({THINK_END: False})
        self._answer = "lead"  # lead (blanks so far), inside (after <response>), plain
        self._held = ""

    def feed(self, text: str) -> list[Event]:
        return self._unwrap(super().feed(text), final=False)

    def finish(self) -> list[Event]:
        return self._unwrap(super().finish(), final=True)

    def _unwrap(self, events: list[Event], final: bool) -> list[Event]:
        out = [e for e in events if e[0] == "reasoning"]
        self._held += "".join(e[1] for e in events if e[0] == "content")
        held = self._held
        if self._answer == "lead" and held:
            rest = held.lstrip()
            if rest.startswith(RESPONSE_START):
                self._answer, held = "inside", rest[len(RESPONSE_START):]
            elif not RESPONSE_START.startswith(rest) or final:
                self._answer = "plain"
        if self._answer == "plain":
            text, held = held, ""
        elif self._answer == "inside":  # held from the last </response> (or what may begin one) on
            at = held.rfind(RESPONSE_END)
            if at < 0:
                at = len(held) - (0 if final else _held_suffix(held, (RESPONSE_END,)))
            text, held = held[:at], held[at:]
            if final:
                held = ""  # the last </response> and what follows it go
        else:
            text = ""
        self._held = held
        return out + ([("content", text)] if text else [])


class MistralReasoningParser(ReasoningParser):
    """mistral: content, `[THINK]` reasoning `[/THINK]`, content; a `[/THINK]` before any `[THINK]` dropped (the
    first)."""

    def __init__(self):
        super().__init__({MISTRAL_THINK_END: False})
        self._state = "before"  # before (content), reasoning, content
        self._dropped = False  # a stray [/THINK] was dropped

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        return self._run(final=False)

    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        if self._state == "before":
            tags = (MISTRAL_THINK,) if self._dropped else (MISTRAL_THINK, MISTRAL_THINK_END)
            found = [(at, tag) for at, tag in ((self._buffer.find(tag), tag) for tag in tags) if at >= 0]
            if not found:
                keep = 0 if final else _held_suffix(self._buffer, tags)
                text, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
                return [("content", text)] if text else []
            at, tag = min(found)
            out += [("content", self._buffer[:at])] if at else []
            self._buffer = self._buffer[at + len(tag):]
            if tag == MISTRAL_THINK_END:
                self._dropped = True
                return out + self._run(final)
            self._state = "reasoning"
        if self._state == "reasoning":
            out += self._reasoning()
        if self._state == "content" and self._buffer:
            out.append(("content", self._buffer))
            self._buffer = ""
        return out

    def finish(self) -> list[Event]:
        return self._run(final=True) + super().finish()


class MiniMaxM2ReasoningParser(ReasoningParser):
    """minimax_m2: reasoning from the first character to the first `</think>`, then content without any `</think>`
    (each taken out as str.replace would: text a removal joins is not read again)."""

    def __init__(self):
        super().__init__({THINK_END: False})
        self._state = "reasoning"

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        out = self._reasoning() if self._state == "reasoning" else []
        return out + (self._content(final=False) if self._state == "content" else [])

    def _content(self, final: bool) -> list[Event]:
        kept: list[str] = []
        while (at := self._buffer.find(THINK_END)) >= 0:
            kept.append(self._buffer[:at])
            self._buffer = self._buffer[at + len(THINK_END):]
        keep = 0 if final else _held_suffix(self._buffer, (THINK_END,))
        kept.append(self._buffer[:len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep:]
        text = "".join(kept)
        return [("content", text)] if text else []

    def finish(self) -> list[Event]:
        if self._state == "content":
            return self._content(final=True)
        return super().finish()


class AppendThinkParser:
    """minimax_m2_append_think: every piece content, the first after `<think>` (the whole output of none: `<think>`)."""

    def __init__(self):
        self._started = False

    def feed(self, text: str) -> list[Event]:
        if not self._started:
            self._started = True
            return [("content", THINK_START + text)]
        return [("content", text)] if text else []

    def finish(self) -> list[Event]:
        return [] if self._started else self.feed("")


def make_parser(name: str, chat_template_kwargs: dict | None = None) -> ReasoningParser:
    """A --reasoning-parser by name, for a request with these chat_template_kwargs."""
    if name == "deepseek_r1":
        return ReasoningParser({THINK_END: False})
    if name == "qwen3":
        return ReasoningParser({THINK_END: False, TOOL_CALL_START: True}, thinks(name, chat_template_kwargs))
    if name in ("glm45", "deepseek_v3"):
        return ReasoningParser({THINK_END: False}, thinks(name, chat_template_kwargs))
    if name == "kimi_k2":
        return ReasoningParser({THINK_END: False, **{tag: True for tag in KIMI_SECTIONS}},
                               thinks(name, chat_template_kwargs))
    if name == "seed_oss":
        return ReasoningParser({SEED_THINK_END: False}, starts=(SEED_THINK_START,))
    if name == "ernie45":
        return Ernie45ReasoningParser()
    if name == "granite":
        return ReasoningParser({tag: False for tag in GRANITE_ENDS}, starts=GRANITE_STARTS, required=True)
    if name == "mistral":
        return MistralReasoningParser()
    if name == "minimax_m2":
        return MiniMaxM2ReasoningParser()
    if name == "minimax_m2_append_think":
        return AppendThinkParser()
    if name == "openai_gptoss":
        from llmc.runtime.server.harmony import HarmonyParser

        return HarmonyParser(tools=False)
    raise ValueError(f"invalid reasoning parser {name!r}; supported: {', '.join(REASONING_PARSERS)}")


def check_name(name: str | None) -> None:
    """ValueError for a --reasoning-parser name llmc does not have (start-up)."""
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"invalid reasoning parser {name!r}; supported: {', '.join(REASONING_PARSERS)}")


def split(parser: ReasoningParser, text: str) -> tuple[str, str]:
    """The whole text at once: (reasoning, content)."""
    events = parser.feed(text) + parser.finish()
    return (("".join(e[1] for e in events if e[0] == "reasoning")),
            "".join(e[1] for e in events if e[0] == "content"))


def thinks(name: str | None, chat_template_kwargs: dict | None) -> bool:
    """Whether a request's output is parsed for reasoning (a parser, and thinking not switched off)."""
    if name is None:
        return False
    kwargs = chat_template_kwargs or {}
    switches = [kwargs.get(key) for key in ("enable_thinking", "thinking")]
    if name == "glm45":  # vLLM's: on unless either switch is given and neither is true
        return all(value is None for value in switches) or any(bool(value) for value in switches)
    if name == "deepseek_v3":  # vLLM's: off unless either switch is true
        return any(bool(value) for value in switches)
    if name == "kimi_k2":  # vLLM's: on unless "thinking" is false
        return bool(kwargs.get("thinking", True))
    return name != "qwen3" or kwargs.get("enable_thinking", True) is not False


class WithReasoning:
    """A reasoning parser whose content goes on through a tool parser (None: the content is the
    answer): the tool parser's interface (`feed`, `finish`, `called`), plus ("reasoning", text) events."""

    def __init__(self, reasoning: ReasoningParser, tools: Any = None):
        self.reasoning = reasoning
        self.tools = tools

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.called

    def _through_tools(self, events: list[Event], finished: bool) -> list[Event]:
        if self.tools is None:
            return events
        out: list[Event] = []
        for event in events:
            out += [event] if event[0] == "reasoning" else self.tools.feed(event[1])
        return out + (self.tools.finish() if finished else [])

    def feed(self, text: str) -> list[Event]:
        return self._through_tools(self.reasoning.feed(text), False)

    def finish(self) -> list[Event]:
        return self._through_tools(self.reasoning.finish(), True)


def with_reasoning(name: str | None, request: Any, tool_parser: Any) -> Any:
    """The parser of one choice's text: `tool_parser` (None: all content) behind the server's reasoning
    parser when the request's output is parsed for reasoning, else `tool_parser` itself."""
    if not thinks(name, request.chat_template_kwargs):
        return tool_parser
    if name == "openai_gptoss":  # one harmony parser reads it all: --tool-call-parser openai's when calls are read
        return tool_parser if tool_parser is not None else make_parser(name)
    return WithReasoning(make_parser(name, request.chat_template_kwargs), tool_parser)


def reasoning_of(events: list[Event]) -> tuple[str | None, list[Event]]:
    """The reasoning text of a whole reply's events (None when there was none), and the other events."""
    reasoning = "".join(e[1] for e in events if e[0] == "reasoning")
    return reasoning or None, [e for e in events if e[0] != "reasoning"]


def fields(name: str | None, reasoning: str | None) -> dict:
    """A message's or delta's reasoning fields: vLLM's `reasoning` and the older `reasoning_content`
    (DeepSeek's name, which the openai SDK exposes as an extra attribute like the other), with the same
    text; none on a server without a reasoning parser."""
    if name is None:
        return {}
    return {"reasoning": reasoning, "reasoning_content": reasoning}


def delta_fields(name: str | None, events: list[Event]) -> dict:
    """A stream delta's reasoning fields for these events: only when they hold reasoning text."""
    reasoning, _ = reasoning_of(events)
    return fields(name, reasoning) if reasoning else {}


def count_tokens(tokenizer, reasoning: str | None) -> int:
    """The tokens of the reasoning text (usage.completion_tokens_details.reasoning_tokens): the text
    re-tokenized, as the generated tags may be pieces of several tokens."""
    if not reasoning:
        return 0
    return len(tokenizer.encode(reasoning, add_special_tokens=False))


def check_request(name: str | None, request: Any, whole_output_constrained: bool) -> None:
    """400 for structured output or a forced tool call on a request whose output is parsed for
    reasoning: vLLM starts those constraints where the reasoning ends, which llmc's structured output
    cannot do; constraining the whole output would keep the model from thinking. With
    `whole_output_constrained` (vLLM's structured_outputs_config enable_in_reasoning) an output
    constraint applies to the whole output, reasoning included, and is allowed."""
    from llmc.runtime.server.errors import invalid

    if not thinks(name, request.chat_template_kwargs):
        return
    mode = request.tool_mode
    if mode in ("required", "named"):
        raise invalid("tool_choice", f"tool_choice {'required' if mode == 'required' else 'naming a function'} "
                      f"constrains the output to tool calls, which with --reasoning-parser {name} vLLM starts after "
                      "the reasoning; llmc cannot start a constraint there: send tool_choice \"auto\" (the calls are "
                      "read from the answer after the reasoning) or \"none\""
                      + (f", or chat_template_kwargs {_THINKING_OFF[name]}" if name in _THINKING_OFF else ""))
    constraints = request._output_constraints()
    if constraints and not whole_output_constrained:
        raise invalid(constraints[0], f"structured output ({', '.join(constraints)}) with --reasoning-parser {name}: "
                      "vLLM constrains only the answer after the reasoning, which llmc cannot do; leave it out"
                      + (f", send chat_template_kwargs {_THINKING_OFF[name]}" if name in _THINKING_OFF else "")
                      + ", or start the server with --structured-outputs-config '{\"enable_in_reasoning\": true}' "
                      "to constrain the whole output, reasoning included")


def with_reasoning_tokens(usage: dict, ctx: Any, request: Any, output: Any) -> dict:
    """`usage` plus, on a server with a reasoning parser, vLLM's completion_tokens_details.reasoning_tokens:
    the tokens of every returned sequence's reasoning (0 where the output is not parsed for reasoning)."""
    name = ctx.reasoning_parser
    if name is None:
        return usage
    count = 0
    if thinks(name, request.chat_template_kwargs):
        for completion in output.outputs:
            thought, _ = split(make_parser(name, request.chat_template_kwargs), completion.text)
            count += count_tokens(ctx.tokenizer, thought)
    return {**usage, "completion_tokens_details": {"reasoning_tokens": count}}
