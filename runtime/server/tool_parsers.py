"""Tool calls read out of generated text, as the text streams (vLLM's tool call parsers, by name).

A parser is fed the text of one sequence a piece at a time (`feed`) and told when it ends
(`finish`); it returns events in output order: ("content", text), ("call", index, name) when a
call's name is known (("call", index, name, id) where the model wrote the call's id: kimi_k2's), ("args",
index, text) with the next piece of that call's arguments. The non-streaming reply folds the same events
(`parse`), so a stream's joined content and argument pieces equal the non-streamed message whatever the
pieces were: every decision depends on the text, never on where it was split. Arguments are the JSON text of
the arguments value as generated (vLLM re-serializes a parsed object with json.dumps; the text here is the
same JSON value, with the model's own spacing), except pythonic's (and olmo3's), which are not JSON as
generated.

Parsers (`--tool-call-parser`):
* hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes 2 Pro, Qwen 2.5 /
  3, ...); the text outside the blocks is content. A block whose name cannot be read (not JSON, no
  "name" string) is content, tags included. A block left open at the end counts up to the end. Models
  that name the arguments "parameters" (Llama 3's key) keep them: the first of the two keys counts.
* llama3_json: output that starts with a JSON object {"name": ..., "parameters" (or "arguments"): ...}
  (after an optional `<|python_tag|>`), or several separated by ";" (Llama 3.1-3.3, 4). Output that
  starts otherwise is all content; text after the last object is content. llama4_json is this parser
  (vLLM registers its Llama 3 JSON parser under both names).
* mistral: `[TOOL_CALLS]` then a JSON array of {"name": ..., "arguments": {...}} objects (Mistral's
  tokenizers before v11), or `[TOOL_CALLS]name[ARGS]{...}`, repeated for more calls (v11+: Mistral Small
  3.2, Magistral, Devstral); the text outside the calls is content. (Both tags are special tokens:
  requests with tools under this parser keep special tokens in the text, as for hermes.)
* pythonic: output that is a Python list of calls with literal keyword arguments,
  `[get_weather(city="Paris"), get_time()]` (Llama 3.2, Llama 4, optionally in `<|python_start|>` ...
  `<|python_end|>`); the arguments are json.dumps of the keywords, so not the text as generated. The
  list is read whole at its closing `]` (no call streams before); output that starts otherwise, or a
  list with anything but such calls, is all content. llama4_pythonic (vLLM's Llama4PythonicToolParser) is this
  parser: Llama 4's calls in `<|python_start|>` ... `<|python_end|>` or bare, read by the same rules.
* ernie45 (ERNIE 4.5, vLLM's ernie45): hermes's blocks, the arguments under "arguments" only (a block without them
  calls the function without any: {}); as in vLLM, nothing after the first call is content.
* granite (Granite 3.x, vLLM's granite): output that is (after blanks, `<|tool_call|>` and / or `<tool_call>`) a
  JSON array of {"name": ..., "arguments": ...} objects; output that starts otherwise is all content, and text after
  the array is dropped.
* olmo3 (OLMo 3, vLLM's olmo3): `<function_calls>` then one Python call a line, JSON's true / false / null as
  literals too, then `</function_calls>` (Olmo3ToolParser).
* openai: gpt-oss's harmony messages, a call being a message to `functions.NAME` (runtime/server/harmony.py;
  with --reasoning-parser openai_gptoss only, which reads the whole output).
Plus the forms of tool_choice "required" (a JSON array of {"name", "parameters"} objects, generated
under a grammar) and a named tool_choice (the whole output is the arguments).

Whitespace around content next to calls is dropped once a call was read (the text between two
blocks is usually a newline); output with no call comes back as content exactly.
"""

from __future__ import annotations

import ast
import json
import re

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "glm45", "glm47", "qwen3_coder", "deepseek_v3",
                     "deepseek_v31", "minimax_m2", "openai", "llama4_json", "llama4_pythonic",
                     "kimi_k2", "seed_oss", "ernie45", "granite", "olmo3")
# vLLM's names of formats llmc does not read, refused by name at start-up
NOT_BUILT = {"deepseek_v32": "DeepSeek-V3.2's DSML calls are not read by llmc"}

Event = tuple  # ("content", str) | ("call", int, str) | ("call", int, str, str) | ("args", int, str)


class _ObjectScanner:
    """Reads one JSON object a character at a time: the string value of `name_key`, and the text of
    the first value under one of `args_keys` as it grows. Strict at the object's own level (keys,
    colons, commas), lenient inside values (only brackets and strings are tracked)."""

    def __init__(self, args_keys: tuple[str, ...]):
        self.args_keys = args_keys
        self.state = "start"  # start, key_or_end, key_next, key, colon, value_start, value, after_value, done, error
        self.name: str | None = None
        self.args: list[str] | None = None  # the arguments value's characters so far
        self.args_complete = False
        self._key: list[str] = []
        self._current_key: str | None = None
        self._value: list[str] = []
        self._stack: list[str] = []
        self._in_string = False
        self._escape = False

    @property
    def closed(self) -> bool:
        return self.state in ("done", "error")

    def args_text(self) -> str | None:
        """The arguments read so far: up to their last non-blank character while they are open."""
        if self.args is None:
            return None
        text = "".join(self.args)
        return text if self.args_complete else text.rstrip()

    def feed(self, char: str) -> None:
        state = self.state
        if state in ("done", "error"):
            return
        if state == "key":
            self._read_key(char)
        elif state == "value":
            self._read_value(char)
        elif char.isspace():
            return
        elif state == "start":
            self.state = "key_or_end" if char == "{" else "error"
        elif state in ("key_or_end", "key_next"):
            if char == '"':
                self.state, self._key, self._escape = "key", [], False
            else:
                self.state = "done" if char == "}" and state == "key_or_end" else "error"
        elif state == "colon":
            self.state = "value_start" if char == ":" else "error"
        elif state == "value_start":
            self._start_value(char)
        elif state == "after_value":
            self.state = {",": "key_next", "}": "done"}.get(char, "error")

    def _read_key(self, char: str) -> None:
        if self._escape:
            self._escape = False
        elif char == "\\":
            self._escape = True
        elif char == '"':
            try:
                self._current_key = json.loads('"' + "".join(self._key) + '"')
            except ValueError:
                self.state = "error"
                return
            self.state = "colon"
            return
        self._key.append(char)

    def _start_value(self, char: str) -> None:
        if char in "}],:":
            self.state = "error"
            return
        self._value, self._stack, self._in_string, self._escape = [], [], False, False
        self.state = "value"
        if char == '"':
            self._in_string = True
        elif char in "{[":
            self._stack.append(char)
        self._append(char)

    def _is_args(self) -> bool:
        return self._current_key in self.args_keys and (self.args is None or self.args is self._value)

    def _append(self, char: str) -> None:
        self._value.append(char)
        if self._is_args() and self.args is None:
            self.args = self._value

    def _read_value(self, char: str) -> None:
        if self._in_string:
            self._append(char)
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._in_string = False
                if not self._stack:
                    self._end_value("after_value")
            return
        if self._stack:
            if char == '"':
                self._in_string = True
            elif char in "{[":
                self._stack.append(char)
            elif char in "}]":
                if {"}": "{", "]": "["}[char] != self._stack[-1]:
                    self.state = "error"
                    return
                self._stack.pop()
                self._append(char)
                if not self._stack:
                    self._end_value("after_value")
                return
            self._append(char)
            return
        # a number or a literal (true, false, null) at the object's level
        if char.isspace() or char in ",}":
            self._end_value({",": "key_next", "}": "done"}.get(char, "after_value"))
        elif char in '{["':
            self.state = "error"
        else:
            self._append(char)

    def _end_value(self, next_state: str) -> None:
        self.state = next_state
        if self._current_key == "name" and self.name is None:
            try:
                name = json.loads("".join(self._value))
            except ValueError:
                name = None
            if not isinstance(name, str) or not name:
                self.state = "error"  # a call's name is a non-empty string
                return
            self.name = name
        if self.args is self._value:
            self.args_complete = True


class _Call:
    """One call being read: its index, the scanner of its object, what was sent of it."""

    def __init__(self, index: int, args_keys: tuple[str, ...]):
        self.index = index
        self.scanner = _ObjectScanner(args_keys)
        self.announced = False
        self.sent_args = 0

    def events(self) -> list[Event]:
        """The call's name once known, then each new piece of its arguments."""
        out: list[Event] = []
        if self.scanner.name is None:
            return out
        if not self.announced:
            self.announced = True
            out.append(("call", self.index, self.scanner.name))
        args = self.scanner.args_text()
        if args is not None and len(args) > self.sent_args:
            out.append(("args", self.index, args[self.sent_args:]))
            self.sent_args = len(args)
        return out

    def close(self) -> list[Event]:
        """The end of the call (its object closed, broke, or the output ended). A closed object that gave
        no arguments called the function without any: {}. One cut (by max_tokens, a stop string) or broken
        before its arguments keeps what was generated of them, nothing: an invented {} would pass for a
        whole call."""
        out = self.events()
        if self.announced and self.scanner.args is None and self.scanner.state == "done":
            out.append(("args", self.index, "{}"))
            self.sent_args = 2
        return out


class ToolParser:
    """Base: `feed` each new piece of one sequence's text, then `finish`; `called` once a call was read."""

    def __init__(self):
        self.num_calls = 0
        self._held_blank = ""  # blank text after the content sent, held until more content or the end

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    def feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        raise NotImplementedError

    def _content(self, text: str) -> list[Event]:
        """Content, its trailing blanks held back (dropped at the end when a call was read)."""
        combined = self._held_blank + text
        kept = combined.rstrip()
        self._held_blank = combined[len(kept):]
        return [("content", kept)] if kept else []

    def _end_content(self) -> list[Event]:
        held, self._held_blank = self._held_blank, ""
        return [("content", held)] if held and not self.called else []

    def _new_call(self, args_keys: tuple[str, ...]) -> _Call:
        return _Call(self.num_calls, args_keys)

    def _count(self, events: list[Event]) -> list[Event]:
        self.num_calls += sum(1 for e in events if e[0] == "call")
        return events

    def _whole_calls(self, calls: list[tuple[str, str]]) -> list[Event]:
        """The events of calls read whole, (name, JSON arguments or "" for none), numbered on from the calls sent."""
        out: list[Event] = []
        for index, (name, args) in enumerate(calls, start=self.num_calls):
            out.append(("call", index, name))
            if args:
                out.append(("args", index, args))
        return self._count(out)


def _held_prefix(text: str, tag: str) -> int:
    """How many characters at the end of `text` might begin `tag` (held back until the next piece)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def _held(text: str, tags: tuple[str, ...]) -> int:
    """How many characters at the end of `text` might begin one of `tags`."""
    return max(_held_prefix(text, tag) for tag in tags)


def _first(text: str, tags: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest of `tags` in `text`: (index, tag), or None."""
    found = [(text.find(tag), tag) for tag in tags]
    found = [hit for hit in found if hit[0] >= 0]
    return min(found) if found else None


class HermesToolParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"
    ARGS_KEYS = ("arguments", "parameters")

    def __init__(self):
        super().__init__()
        self._buffer = ""
        self._call: _Call | None = None  # inside a block
        self._raw: list[str] = []  # the open block's text (content if it holds no call)

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        out: list[Event] = []
        while self._buffer:
            if self._call is None:
                at = self._buffer.find(self.START)
                if at < 0:
                    keep = _held_prefix(self._buffer, self.START)
                    out += self._content(self._buffer[:len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    break
                out += self._content(self._buffer[:at])
                self._buffer = self._buffer[at + len(self.START):]
                self._call, self._raw = self._new_call(self.ARGS_KEYS), []
            else:
                at = self._buffer.find(self.END)
                if at < 0:
                    keep = _held_prefix(self._buffer, self.END)
                    out += self._block_text(self._buffer[:len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    break
                out += self._block_text(self._buffer[:at])
                self._buffer = self._buffer[at + len(self.END):]
                out += self._close_block(self.END)
        return out

    def _block_text(self, text: str) -> list[Event]:
        self._raw.append(text)
        for char in text:
            self._call.scanner.feed(char)
        return self._count(self._call.events())

    def _close_block(self, end: str) -> list[Event]:
        call, self._call = self._call, None
        if call.scanner.name is None:  # not a call: the block is content, tags and all
            return self._content(self.START + "".join(self._raw) + end)
        return self._count(call.close())

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._call is not None:  # a block left open: it ends with the output
            out += self._block_text(self._buffer)
            out += self._close_block("")
        elif self._buffer:
            out += self._content(self._buffer)
        self._buffer = ""
        return out + self._end_content()


class JsonCallsParser(ToolParser):
    """JSON objects one after another: `opener` (optional text first), `separator` between them,
    `closer` after the last (None: the output's end). `content`: whether text that is not a call is
    content (llama3_json) or dropped (the array a "required" tool_choice generates)."""

    def __init__(self, args_keys: tuple[str, ...], separator: str, opener: str = "", closer: str | None = None,
                 prefix_tag: str = "", content: bool = True):
        super().__init__()
        self.args_keys, self.separator, self.opener, self.closer = args_keys, separator, opener, closer
        self.prefix_tag, self.keeps_content = prefix_tag, content
        self._mode = "lead"  # lead, opened, object, between, content, drop
        self._raw: list[str] = []  # text held while it is not known to be a call (content if it is not)
        self._call: _Call | None = None
        self._after_separator = False

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        for char in text:
            out += self._char(char)
        return out

    def _char(self, char: str) -> list[Event]:
        mode = self._mode
        if mode == "content":
            return self._content(char) if self.keeps_content else []
        if mode == "drop":
            return []
        self._raw.append(char)
        if mode == "lead":
            raw = self._after_tags("".join(self._raw))
            if raw is None:
                return []  # maybe the tag
            if not raw.strip():
                return []
            expected = self.opener or "{"
            if raw.lstrip() == expected:
                if self.opener:
                    self._mode = "opened"
                    return []
                return self._start_object(char)
            return self._not_calls()
        if mode == "opened":  # after the opener, before the first object
            if char.isspace():
                return []
            if char == "{":
                return self._start_object(char)
            return self._not_calls()
        if mode == "object":
            self._call.scanner.feed(char)
            scanner = self._call.scanner
            if scanner.closed and scanner.name is None:  # not a call after all
                return self._not_calls()
            if scanner.closed:
                call, self._call = self._call, None
                self._mode = "between" if scanner.state == "done" else "drop"
                self._raw, self._after_separator = [], False
                return self._count(call.close())
            events = self._count(self._call.events())
            if events:
                self._raw = []
            return events
        # between objects
        if char.isspace():
            return []
        if char == self.separator and not self._after_separator:
            self._after_separator = True
            return []
        if char == "{" and self._after_separator:
            return self._start_object(char)
        if self.closer is not None and char == self.closer and not self._after_separator:
            self._mode, self._raw = "drop", []
            return []
        return self._not_calls()

    def _after_tags(self, raw: str) -> str | None:
        """The output so far without its opening tag, or None while it may be one."""
        if self.prefix_tag and raw.startswith(self.prefix_tag):
            return raw[len(self.prefix_tag):]
        if self.prefix_tag and self.prefix_tag.startswith(raw):
            return None
        return raw

    def _start_object(self, char: str) -> list[Event]:
        self._mode = "object"
        self._call = self._new_call(self.args_keys)
        self._call.scanner.feed(char)
        return []

    def _not_calls(self) -> list[Event]:
        """What was held is not a call: it and the rest of the output are content (or dropped)."""
        raw, self._raw, self._call = "".join(self._raw), [], None
        if self.called:  # the text after the calls, without the blanks that parted it from them
            raw = raw.lstrip()
        self._mode = "content" if self.keeps_content else "drop"
        return self._content(raw) if self.keeps_content else []

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._mode == "object" and self._call.scanner.name is not None:
            out += self._count(self._call.close())
        elif self._mode in ("lead", "opened", "object") and self._raw:
            out += self._not_calls()
        self._mode, self._call, self._raw = "drop", None, []
        return out + self._end_content()


class Ernie45ToolParser(HermesToolParser):
    """ERNIE 4.5's calls: hermes's blocks, the arguments under "arguments" only; nothing after the first call is
    content (vLLM's ernie45, both its paths)."""

    ARGS_KEYS = ("arguments",)

    def _content(self, text: str) -> list[Event]:
        return [] if self.called else super()._content(text)


class GraniteToolParser(JsonCallsParser):
    """Granite 3.x's calls: `<|tool_call|>` (3.0) and / or `<tool_call>` (3.1+), then a JSON array of {"name",
    "arguments"} objects; output that starts otherwise is all content, text after the array is dropped."""

    TAGS = ("<|tool_call|>", "<tool_call>")

    def __init__(self):
        super().__init__(("arguments",), ",", opener="[", closer="]")

    def _after_tags(self, raw: str) -> str | None:
        rest = raw.lstrip()
        for tag in self.TAGS:
            if rest.startswith(tag):
                rest = rest[len(tag):].lstrip()
            elif rest and tag.startswith(rest):
                return None
        return rest


def _merged(events: list[Event]) -> list[Event]:
    """Adjacent pieces of one call's arguments as one."""
    out: list[Event] = []
    for event in events:
        if event[0] == "args" and out and out[-1][0] == "args" and out[-1][1] == event[1]:
            out[-1] = ("args", event[1], out[-1][2] + event[2])
        else:
            out.append(event)
    return out


_NAME = re.compile(r"[\w.-]+")  # a function's name in Mistral's [TOOL_CALLS]name[ARGS] form


class BufferedToolParser(ToolParser):
    """A parser that reads its text from one buffer: `_run(final)` turns what the buffer holds into events (holding
    back what may begin a tag, unless `final`); pieces of the same kind that follow each other are merged."""

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        return _merged(self._run(final=False))

    def finish(self) -> list[Event]:
        return _merged(self._run(final=True) + self._end_content())

    def _run(self, final: bool) -> list[Event]:
        raise NotImplementedError


class MistralToolParser(BufferedToolParser):
    """`[TOOL_CALLS]` then the calls of one segment: a JSON array of {"name", "arguments"} objects
    (tokenizers before v11), or `name[ARGS]{...}`, one call (v11+); what follows the tag decides (`[`:
    the array). The text outside segments is content. A segment whose first call cannot be read is
    content, the tag included (the text after the tag is read again, so a later tag still counts); one
    that breaks after a call was read keeps its calls, and its text up to the next tag is dropped."""

    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self):
        super().__init__()
        self._buffer = ""
        # content, skip (dropped up to the next tag), lead (after the tag), name, args, array, object, between
        self._state = "content"
        self._raw = ""  # the segment's text while none of its calls was read
        self._reread = ""  # that text after the tag, when it turned out not to be a call
        self._segment_called = False
        self._call: _Call | None = None  # the array form's object being read
        self._index = 0  # the v11 call's index
        self._started = False  # its arguments' opening brace read
        self._blank = ""  # its arguments' blanks not sent yet (sent with what follows them)
        self._depth = 0
        self._in_string = self._escape = False

    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            state = self._state
            if self._reread:  # a segment that was not a call: its text after the tag, read again
                self._buffer, self._reread = self._reread + self._buffer, ""
            if state in ("content", "skip"):
                at = self._buffer.find(self.TAG)
                if at < 0:
                    keep = 0 if final else _held_prefix(self._buffer, self.TAG)
                    text, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
                    return out + (self._content(text) if state == "content" else [])
                if state == "content":
                    out += self._content(self._buffer[:at])
                self._buffer = self._buffer[at + len(self.TAG):]
                self._state, self._raw, self._segment_called = "lead", self.TAG, False
            elif state == "name":
                at = self._buffer.find(self.ARGS)
                if at >= 0:
                    name = self._buffer[:at].rstrip()
                    if _NAME.fullmatch(name):
                        self._buffer = self._buffer[at + len(self.ARGS):]
                        out += self._start_args(name)
                    else:
                        out += self._broken()
                    continue
                keep = _held_prefix(self._buffer, self.ARGS)
                if final or not re.fullmatch(r"[\w.-]*\s*", self._buffer[:len(self._buffer) - keep]):
                    out += self._broken()
                    continue
                return out
            elif self._buffer:  # the states read a character at a time
                buffer, i = self._buffer, 0
                while i < len(buffer) and self._state == state:
                    out += self._char(buffer[i])
                    i += 1
                self._buffer = buffer[i:]
            elif final:
                out += self._end_segment()
            else:
                return out

    def _char(self, char: str) -> list[Event]:
        state = self._state
        if not self._segment_called:
            self._raw += char
        if state == "args":
            return self._args_char(char)
        if state == "object":
            scanner = self._call.scanner
            scanner.feed(char)
            if scanner.closed and scanner.name is None:
                return self._broken()
            if scanner.closed:
                call, self._call, self._segment_called = self._call, None, True
                out = self._count(call.close())
                if scanner.state == "done":
                    self._state = "between"
                    return out
                return out + self._broken()
            out = self._count(self._call.events())
            self._segment_called = self._segment_called or bool(out)
            return out
        if char.isspace():
            return []
        if state == "lead":
            if char == "[":
                self._state = "array"
            else:  # the name: read again, as a whole
                self._state, self._raw, self._reread = "name", self._raw[:-1], char
            return []
        if state == "array" and char == "{":
            self._state, self._call = "object", self._new_call(("arguments", "parameters"))
            self._call.scanner.feed(char)
            return []
        if state == "between" and char in ",]":
            self._state = "array" if char == "," else "content"
            return []
        return self._broken()

    def _start_args(self, name: str) -> list[Event]:
        self._state, self._segment_called, self._raw = "args", True, ""
        self._index, self._started, self._blank = self.num_calls, False, ""
        self._depth, self._in_string, self._escape = 0, False, False
        return self._count([("call", self._index, name)])

    def _args_char(self, char: str) -> list[Event]:
        """The v11 arguments: one JSON object, read to its closing brace (only strings and brackets tracked)."""
        if not self._started:
            if char.isspace():
                return []
            if char != "{":
                return self._broken()  # no arguments: the call stands without any, as written
            self._started = True
        if self._in_string:
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._in_string = False
        elif char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
        if self._depth == 0:
            self._state = "content"
        elif char.isspace():
            self._blank += char
            return []
        piece, self._blank = self._blank + char, ""
        return [("args", self._index, piece)]

    def _end_segment(self) -> list[Event]:
        """The output ended inside a segment: a call cut keeps what was generated of it."""
        state, call = self._state, self._call
        if state == "object" and call.scanner.name is not None:
            self._state, self._call = "skip", None
            return self._count(call.close())
        if state in ("lead", "name", "array", "object") and not self._segment_called:
            return self._broken()
        self._state = "skip"
        return []

    def _broken(self) -> list[Event]:
        """The segment cannot be read on: content (the tag, then its text read again) if no call of it was read."""
        self._call = None
        if self._segment_called:
            self._state = "skip"
            return []
        raw, self._raw = self._raw, ""
        self._state, self._reread = "content", raw[len(self.TAG):] + self._reread
        return self._content(self.TAG)


class _JsonNames(ast.NodeTransformer):
    """JSON's true, false and null written as names, read as the constants (vLLM's olmo3 rule)."""

    VALUES = {"true": True, "false": False, "null": None}

    def visit_Name(self, node: ast.Name) -> ast.AST:
        return ast.Constant(self.VALUES[node.id]) if node.id in self.VALUES else node


def _python_call(node: ast.expr, json_names: bool = False) -> tuple[str, str] | None:
    """(name, JSON arguments) of `name(key=literal, ...)`, or None for anything else (`json_names`: true, false
    and null are literals too)."""
    if (not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args
            or any(kw.arg is None for kw in node.keywords)):  # positional arguments, **kwargs
        return None
    try:
        values = [_JsonNames().visit(kw.value) if json_names else kw.value for kw in node.keywords]
        kwargs = {kw.arg: ast.literal_eval(value) for kw, value in zip(node.keywords, values)}
        return node.func.id, json.dumps(kwargs, ensure_ascii=False, allow_nan=False)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):  # not a literal, not JSON
        return None


def _python_calls(elements: list[str], json_names: bool = False) -> list[tuple[str, str]] | None:
    """The calls of a list's elements (each the text of one), or None if one is not a call."""
    calls = []
    for element in elements:
        try:
            call = _python_call(ast.parse(element.strip(), mode="eval").body, json_names)
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            return None
        if call is None:
            return None
        calls.append(call)
    return calls


_CUT_CALL = re.compile(r"\s*([A-Za-z_]\w*)\s*\(")


def _calls_cut_at_end(elements: list[str], json_names: bool = False) -> list[tuple[str, str]] | None:
    """The calls of a list of calls the output ended inside (each element the text of one): every element but the
    last must be a whole call; the last is a whole one, a call cut after `name(` (standing with no arguments: none
    invented), or blank. None if not."""
    calls = _python_calls(elements[:-1], json_names)
    if calls is None or not elements or not elements[-1].strip():
        return calls
    whole = _python_calls(elements[-1:], json_names)
    cut = _CUT_CALL.match(elements[-1])
    return calls + whole if whole is not None else calls + [(cut.group(1), "")] if cut else None


class PythonicToolParser(ToolParser):
    """Output that is a Python list of calls with keyword arguments of literal values,
    `[f(a=1, b="x"), g()]` (Llama 3.2, Llama 4; optionally in `<|python_start|>` ... `<|python_end|>`),
    the arguments sent as JSON (json.dumps of the keywords). Output that starts otherwise is all content.
    The list is held until its closing `]` (or the end) and read whole: if any element is not such a call,
    the whole text is content, streamed or not, so no call is sent before the list closed. Text after
    the list (and `<|python_end|>`) is content. A list cut at the end keeps its whole calls, and a call cut
    after `name(` stands with the arguments generated of it, none (nothing invented)."""

    START, END = "<|python_start|>", "<|python_end|>"

    def __init__(self):
        super().__init__()
        self._buffer = ""
        self._state = "lead"  # lead, list, after (the list read: blanks, END), content
        self._start = 0  # where the list begins in the buffer
        self._pos = 0  # how far the list was scanned
        self._depth = 0
        self._quote = ""  # the open string's quote (', ", ''' or """), "" outside strings
        self._escape = False
        self._closing = 0  # closing quotes seen in a row, in a triple-quoted string
        self._commas: list[int] = []  # the list's own commas

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        return self._step(final=False)

    def finish(self) -> list[Event]:
        return self._step(final=True) + self._end_content()

    def _step(self, final: bool) -> list[Event]:
        if self._state == "lead":
            rest = self._buffer.lstrip()
            if rest.startswith(self.START):
                rest = rest[len(self.START):].lstrip()
            elif self.START.startswith(rest) and not final:
                return []  # maybe the tag
            if not rest:
                return [] if not final else self._all_content()
            if rest[0] != "[":
                return self._all_content()
            self._state, self._start = "list", len(self._buffer) - len(rest)
            self._pos = self._start
        if self._state == "list":
            end = self._scan(final)
            if end is None:
                return self._cut_list() if final else []
            calls = self._list_calls(end)
            if calls is None:
                return self._all_content()
            self._buffer, self._state = self._buffer[end + 1:], "after"
            return self._whole_calls(calls) + self._step(final)
        if self._state == "after":
            rest = self._buffer.lstrip()
            if rest.startswith(self.END):
                rest = rest[len(self.END):].lstrip()
            elif self.END.startswith(rest) and not final:
                return []  # blanks, maybe the tag
            if not rest and not final:
                return []
            self._buffer, self._state = "", "content"
            return self._content(rest)
        text, self._buffer = self._buffer, ""
        return self._content(text)

    def _scan(self, final: bool) -> int | None:
        """Reads the list on from `_pos`: the index of its closing `]`, or None while it is open."""
        text = self._buffer
        while self._pos < len(text):
            i, char = self._pos, text[self._pos]
            if self._quote:
                if self._escape or char == "\\" or char != self._quote[0]:
                    self._escape, self._closing = not self._escape and char == "\\", 0
                else:
                    self._closing += 1
                    if self._closing == len(self._quote):
                        self._quote, self._closing = "", 0
            elif char in "'\"":
                if text.startswith(char * 3, i):
                    self._quote, self._closing, self._pos = char * 3, 0, i + 3
                    continue
                if (char * 2).startswith(text[i:]) and not final:
                    return None  # one quote or three: the next characters tell
                self._quote = char
            elif char in "([{":
                self._depth += 1
            elif char in ")]}":
                self._depth -= 1
                if self._depth == 0:
                    return i
            elif char == "," and self._depth == 1:
                self._commas.append(i)
            self._pos = i + 1
        return None

    def _list_calls(self, end: int) -> list[tuple[str, str]] | None:
        try:
            node = ast.parse(self._buffer[self._start:end + 1], mode="eval").body
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            return None
        if not isinstance(node, ast.List) or not node.elts:
            return None
        calls = [_python_call(element) for element in node.elts]
        return None if None in calls else calls

    def _cut_list(self) -> list[Event]:
        """The output ended inside the list: its whole elements must be calls, the last may be a cut one."""
        bounds = [self._start] + self._commas + [len(self._buffer)]
        calls = _calls_cut_at_end([self._buffer[a + 1:b] for a, b in zip(bounds, bounds[1:])])
        if not calls:
            return self._all_content()
        self._buffer, self._state = "", "content"
        return self._whole_calls(calls)

    def _all_content(self) -> list[Event]:
        text, self._buffer, self._state = self._buffer, "", "content"
        return self._content(text)


class Olmo3ToolParser(ToolParser):
    """OLMo 3's calls: output that starts (after blanks) with `<function_calls>`, then one Python call a line,
    `get_weather(city="Paris", metric=true)` (JSON's true, false and null read as literals), then
    `</function_calls>`; read whole at the end tag (nothing is sent before), the arguments json.dumps of the
    keywords. If a line is not such a call, or none is there, the whole text is content; output that starts
    otherwise is all content. Text after the end tag is dropped. Cut before the end tag: the whole lines stand if
    they are calls, the last may be a call cut after `name(` (no arguments: none invented)."""

    START, END = "<function_calls>", "</function_calls>"

    def __init__(self):
        super().__init__()
        self._buffer = ""
        self._state = "lead"  # lead, calls, content, drop
        self._start = 0  # where the calls begin in the buffer

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        return self._step(final=False)

    def finish(self) -> list[Event]:
        return self._step(final=True) + self._end_content()

    def _step(self, final: bool) -> list[Event]:
        if self._state == "lead":
            rest = self._buffer.lstrip()
            if rest.startswith(self.START):
                self._state, self._start = "calls", len(self._buffer) - len(rest) + len(self.START)
            elif self.START.startswith(rest) and not final:
                return []  # blanks, or maybe the tag
            else:
                self._state = "content"
        if self._state == "calls":
            at = self._buffer.find(self.END, self._start)
            if at < 0 and not final:
                return []
            lines = [line for line in self._buffer[self._start:at if at >= 0 else None].splitlines() if line.strip()]
            calls = (_python_calls if at >= 0 else _calls_cut_at_end)(lines, json_names=True)
            if not calls:
                self._state = "content"
            else:
                self._buffer, self._state = "", "drop"
                return self._whole_calls(calls)
        if self._state == "content":
            text, self._buffer = self._buffer, ""
            return self._content(text)
        self._buffer = ""
        return []


class NamedToolParser(ToolParser):
    """A named tool_choice: the whole output is the arguments of one call of that function."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def _announce(self) -> list[Event]:
        if self.num_calls:
            return []
        self.num_calls = 1
        return [("call", 0, self.name)]

    def feed(self, text: str) -> list[Event]:
        if not text:
            return []
        return self._announce() + [("args", 0, text)]

    def finish(self) -> list[Event]:
        return self._announce()


def unknown_parser(kind: str) -> str:
    """The error for a --tool-call-parser name llmc does not have."""
    why = f"{NOT_BUILT[kind]}; " if kind in NOT_BUILT else ""
    return f"invalid tool call parser {kind!r}; {why}supported: {', '.join(TOOL_CALL_PARSERS)}"


def make_parser(kind: str, name: str | None = None, tools: list[dict] | None = None) -> ToolParser:
    """`kind`: a --tool-call-parser name, "required", or "named" (with the function's `name`); `tools`:
    the request's (checked) tools, whose parameter schemas type glm45's, glm47's, qwen3_coder's, minimax_m2's and
    seed_oss's values."""
    if kind == "hermes":
        return HermesToolParser()
    if kind == "ernie45":
        return Ernie45ToolParser()
    if kind == "granite":
        return GraniteToolParser()
    if kind == "olmo3":
        return Olmo3ToolParser()
    if kind in ("llama3_json", "llama4_json"):
        return JsonCallsParser(("parameters", "arguments"), ";", prefix_tag="<|python_tag|>")
    if kind == "mistral":
        return MistralToolParser()
    if kind in ("pythonic", "llama4_pythonic"):
        return PythonicToolParser()
    if kind == "openai":
        from llmc.runtime.server.harmony import HarmonyParser

        return HarmonyParser(tools=True)
    if kind in ("glm45", "glm47", "qwen3_coder", "deepseek_v3", "deepseek_v31", "minimax_m2", "kimi_k2", "seed_oss"):
        from llmc.runtime.server import tagged_tool_parsers as tagged
        if kind == "kimi_k2":
            return tagged.KimiK2ToolParser()
        if kind.startswith("deepseek"):
            return (tagged.DeepSeekV3ToolParser if kind == "deepseek_v3" else tagged.DeepSeekV31ToolParser)()
        return {"glm45": tagged.Glm45ToolParser, "glm47": tagged.Glm47ToolParser,
                "qwen3_coder": tagged.Qwen3CoderToolParser, "minimax_m2": tagged.MiniMaxM2ToolParser,
                "seed_oss": tagged.SeedOssToolParser}[kind](tools)
    if kind == "required":
        return JsonCallsParser(("parameters",), ",", opener="[", closer="]", content=False)
    if kind == "named":
        return NamedToolParser(name)
    raise ValueError(unknown_parser(kind))


def fold(events: list[Event]) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) of a list of events: what a whole reply shows."""
    content: list[str] = []
    calls: dict[int, list] = {}
    for event in events:
        if event[0] == "content":
            content.append(event[1])
        elif event[0] == "call":
            calls[event[1]] = [event[2], ""]
        else:
            calls[event[1]][1] += event[2]
    return "".join(content), [tuple(calls[i]) for i in sorted(calls)]


def parse(parser: ToolParser, text: str) -> tuple[str, list[tuple[str, str]]]:
    """The whole text at once: (content, [(name, arguments)])."""
    return fold(parser.feed(text) + parser.finish())
