"""gpt-oss's output in OpenAI's harmony format read apart, as it streams (vLLM's `--reasoning-parser
openai_gptoss` and `--tool-call-parser openai`).

gpt-oss answers in messages: the chat template's generation prompt ends with `<|start|>assistant`, so
the output starts at the first message's header; every later message starts with `<|start|>` and its
role. A header names the channel (`<|channel|>analysis`, `commentary` or `final`) and may name a
recipient (`to=functions.NAME`, before or after the channel) and a content type (`<|constrain|>json`
or a bare `json`); `<|message|>` ends it; the body ends at `<|end|>`, or at `<|call|>` (a tool call)
or `<|return|>` (the answer), the two stop tokens, which end the output and so are usually not in its
text. The markers are special tokens of gpt-oss's tokenizer: requests read here keep special tokens in
the text (serving_chat).

Each message's body goes out as it comes, by its header:
* analysis: ("reasoning", text), the chain of thought;
* final, or commentary with no recipient (a preamble the user may see): ("content", text);
* a recipient `functions.NAME`, when tool calls are read (`tools`): ("call", index, NAME) at the
  header's end, then ("args", index, text) pieces of the body, the arguments as generated;
* any other message (a recipient that is not read as a call: a built-in tool, or calls while tools are
  not read): its text as generated, markers included, as content, so nothing is lost.
Messages for the same field are joined by a newline. Output that does not start as a harmony message
(after blanks), or that goes on after a message with anything but `<|start|>`, is content from there
on, exactly as generated. At the end of the output an open message counts up to the end (a body cut by
max_tokens keeps what was generated); a header cut before its `<|message|>` carries no text and is
dropped, unless it ran past MAX_HEADER characters: that is text, not a header, and is content. Every decision depends on the text, never on where it was split: a marker split across pieces
is held back until it is known, so a stream's events join to the whole text's.
"""

from __future__ import annotations

import re

from llmc.runtime.server.tool_parsers import ToolParser, _first, _held

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
BODY_ENDS = (END, CALL, RETURN, START)  # a `<|start|>` in a body begins the next message (its end was dropped)
FUNCTIONS = "functions."
MAX_HEADER = 256  # characters: a longer text before `<|message|>` is no header (published headers are a few words)

Event = tuple


def read_header(header: str) -> tuple[str | None, str | None]:
    """(channel, recipient) of a message header (the text between `<|start|>` and `<|message|>`)."""
    channel = re.search(re.escape(CHANNEL) + r"\s*([^\s<]+)", header)
    recipient = re.search(r"(?:^|\s|>)to=([^\s<]+)", header)
    return (channel.group(1) if channel else None), (recipient.group(1) if recipient else None)


class HarmonyParser(ToolParser):
    """One sequence's harmony output: ("reasoning", text), ("content", text) and, with `tools`, the tool
    parsers' ("call", index, name) and ("args", index, text) events; `called` once a call was read."""

    def __init__(self, tools: bool):
        super().__init__()
        self.tools = tools
        self._state = "lead"  # lead (blanks so far), header, body, between (after a body), raw (all content)
        self._buffer = ""
        self._header = ""  # the open message's header so far (after <|start|>, or from the output's start)
        self._kind: str | None = None  # the open body's: reasoning, content, call, raw
        self._started: set[str] = set()  # the fields an earlier message wrote to (the next is joined by "\n")
        self._open_fields: set[str] = set()  # the fields the open message (or the raw rest) wrote to
        self._opener = ""  # how the open message's header began in the text: <|start|>, or nothing (the first)

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        out: list[Event] = []
        while self._buffer:
            if self._state == "lead":
                stripped = self._buffer.lstrip()
                for tag in (START, CHANNEL):
                    if stripped.startswith(tag):  # the first message: its header starts with the role or channel
                        self._buffer = stripped[len(START):] if tag == START else stripped
                        self._state, self._header, self._opener = "header", "", tag if tag == START else ""
                        break
                else:
                    if any(tag.startswith(stripped) for tag in (START, CHANNEL)):
                        break  # blanks, or maybe a tag: wait for more
                    self._enter_raw()
            elif self._state == "header":
                at = self._buffer.find(MESSAGE)
                keep = _held(self._buffer, (MESSAGE,)) if at < 0 else 0
                if len(self._header) + (len(self._buffer) - keep if at < 0 else at) > MAX_HEADER:
                    # not a header (whatever follows): text, from the message's start
                    self._buffer, self._header = self._opener + self._header + self._buffer, ""
                    self._enter_raw()
                    continue
                if at < 0:
                    self._header += self._buffer[:len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    break
                self._header += self._buffer[:at]
                self._buffer = self._buffer[at + len(MESSAGE):]
                out += self._open_body()
            elif self._state == "body":
                found = _first(self._buffer, BODY_ENDS)
                if found is None:  # (no whole tag in the buffer: only a tag's start at its end is held)
                    keep = _held(self._buffer, BODY_ENDS)
                    out += self._body(self._buffer[:len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    break
                at, tag = found
                out += self._body(self._buffer[:at])
                if self._kind == "raw" and tag != START:
                    out += self._text("content", tag)
                self._buffer = self._buffer[at + (0 if tag == START else len(tag)):]
                self._state = "between"
            elif self._state == "between":
                if self._buffer.startswith(START):
                    self._buffer = self._buffer[len(START):]
                    self._state, self._header, self._opener = "header", "", START
                elif START.startswith(self._buffer):
                    break
                else:
                    self._enter_raw()
            else:  # raw: the rest is content as generated
                out += self._text("content", self._buffer)
                self._buffer = ""
        return out

    def _enter_raw(self) -> None:
        self._state, self._kind, self._open_fields = "raw", "raw", set()

    def _open_body(self) -> list[Event]:
        """The header is complete: what its body is, and the events that open it."""
        self._state, self._open_fields = "body", set()
        channel, recipient = read_header(self._header)
        if recipient is None and channel == "analysis":
            self._kind = "reasoning"
        elif recipient is None:
            self._kind = "content"
        elif self.tools and recipient.startswith(FUNCTIONS) and len(recipient) > len(FUNCTIONS):
            self._kind = "call"
            self.num_calls += 1
            return [("call", self.num_calls - 1, recipient[len(FUNCTIONS):])]
        else:  # not read as a call: the message as generated is content
            self._kind = "raw"
            return self._text("content", self._opener + self._header + MESSAGE)
        return []

    def _body(self, text: str) -> list[Event]:
        if self._kind == "call":
            return [("args", self.num_calls - 1, text)] if text else []
        return self._text("content" if self._kind == "raw" else self._kind, text)

    def _text(self, field: str, text: str) -> list[Event]:
        """`text` for `field`; a message's first text for a field an earlier message wrote to starts with a newline."""
        if not text:
            return []
        out: list[Event] = []
        if field not in self._open_fields:
            self._open_fields.add(field)
            if field in self._started:
                out.append((field, "\n"))
            self._started.add(field)
        return out + [(field, text)]

    def finish(self) -> list[Event]:
        """The end of the output: an open body counts up to the end; a header never completed is dropped."""
        out: list[Event] = []
        if self._state == "body":
            out += self._body(self._buffer)
        elif self._state in ("lead", "between", "raw") and self._buffer:
            if self._state != "raw":
                self._enter_raw()
            out += self._text("content", self._buffer)
        self._buffer = ""
        return out


GPT_OSS = "GptOssForCausalLM"
TOOL_CALL_PARSER, REASONING_PARSER = "openai", "openai_gptoss"


def check_flags(tool_call_parser: str | None, reasoning_parser: str | None) -> None:
    """ValueError for flags that would lose part of a harmony output: `--tool-call-parser openai` reads calls
    out of the messages of a harmony output, whose analysis messages only `--reasoning-parser openai_gptoss`
    returns; and that reasoning parser reads calls only as `openai` does."""
    if tool_call_parser == TOOL_CALL_PARSER and reasoning_parser != REASONING_PARSER:
        raise ValueError(f"--tool-call-parser {TOOL_CALL_PARSER} reads gpt-oss's harmony messages, whose analysis "
                         f"channel is returned as reasoning: add --reasoning-parser {REASONING_PARSER}")
    if reasoning_parser == REASONING_PARSER and tool_call_parser not in (None, TOOL_CALL_PARSER):
        raise ValueError(f"--reasoning-parser {REASONING_PARSER} reads gpt-oss's harmony messages, tool calls "
                         f"included: use --tool-call-parser {TOOL_CALL_PARSER} with it, not {tool_call_parser}")


def check_model(architecture: str | None, tool_call_parser: str | None, reasoning_parser: str | None) -> None:
    """ValueError for the harmony parsers on an artifact that is not gpt-oss (start-up): other models do
    not write harmony messages."""
    for flag, name in (("--reasoning-parser", reasoning_parser), ("--tool-call-parser", tool_call_parser)):
        if name in (TOOL_CALL_PARSER, REASONING_PARSER) and architecture != GPT_OSS:
            raise ValueError(f"{flag} {name} reads gpt-oss's harmony output ({GPT_OSS}); this artifact is "
                             f"{architecture}: leave it out, or choose the parser of this model's format")
