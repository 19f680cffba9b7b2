"""Tool call parsers of the tag-delimited formats of GLM-4.5 / 4.7, Qwen3-Coder, DeepSeek-V3 / V3.1, MiniMax-M2,
Kimi-K2 and Seed-OSS (vLLM's `--tool-call-parser` glm45, glm47, qwen3_coder, deepseek_v3, deepseek_v31, minimax_m2,
kimi_k2 and seed_oss), on tool_parsers' streaming frame: `feed` / `finish` return ("content", text), ("call",
index, name) and ("args", index, text) events, and every decision depends on the text, never on where it was split.

* glm45 (GLM-4.5 / 4.6, vLLM's glm4_moe_tool_parser): `<tool_call>NAME\\n<arg_key>K</arg_key>\\n
  <arg_value>V</arg_value>\\n...</tool_call>`. The name is the block's text up to its first newline (or
  `<arg_key>`, or `</tool_call>`); a block without one, or whose name has blanks, quotes, braces or angle
  brackets (vLLM takes any first line), is content, the tag included (its text read again).
  A value whose parameter the request's tool declares `"type": "string"` is that string as written;
  any other is read as JSON, else as a Python literal, else kept as the string (vLLM's rule, on the value
  stripped). The arguments are the JSON object of the pairs (vLLM's json.dumps spacing); string values
  stream as they are generated, the others whole at their `</arg_value>`. Text between pairs is ignored,
  and a key not followed by `<arg_value>` is dropped.
* glm47 (GLM-4.7, vLLM's glm47_moe_tool_parser): glm45's, written `<tool_call>NAME<arg_key>K</arg_key>
  <arg_value>V</arg_value></tool_call>` (no newlines; a call without arguments `<tool_call>NAME</tool_call>`).
  The name is the text up to the first `<arg_key>` or `</tool_call>`, and an escaped newline (the two
  characters `\\n`, which GLM-4.7 may write) is read as a blank around the name and between a key and
  its value (vLLM's regexes: `(?:\\\\n|\\s)*` there). A name over two lines is not one.
* qwen3_coder (Qwen3-Coder, Qwen3.5): `<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n
  </function>\\n</tool_call>`, or the `<function=...>` call without the `<tool_call>` tags (vLLM reads that
  too). One newline at each end of a value goes; a parameter left open ends at the next `<parameter=`,
  `</function>` or `</tool_call>`. Values are typed by the parameter's schema as vLLM does: undeclared or
  string-like types as written; "null"/"None" null where the schema allows null or the type is not a
  string; integer types by int(), number types by float() (whole numbers as integers), booleans as
  "true" (any other text is false), objects and arrays as JSON (else a Python literal), other types as a
  Python literal; a value that does not convert stays the string. A list of types or an anyOf counts as
  its first non-null type. Each parameter goes out whole at its end. A first `</parameter>` always ends
  the value (vLLM's newest parser looks past one written inside a value; this one does not). A
  function name with blanks, quotes, braces or angle brackets is not a call: the tags are content.
* deepseek_v3 (DeepSeek-V3 / R1, vLLM's deepseekv3_tool_parser): `<｜tool▁calls▁begin｜>` then calls
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`, then
  `<｜tool▁calls▁end｜>`. The arguments are the JSON text as generated (fences and blanks around it off;
  vLLM's regex needs it on one line, this parser does not). The calls section is never content (vLLM's):
  a call there that cannot be read is dropped.
* deepseek_v31 (DeepSeek-V3.1, V3.2-Exp, vLLM's deepseekv31_tool_parser): the same section, calls
  `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` (no type, no fences: a fence would be part of
  the arguments, as in vLLM). A call without `<｜tool▁sep｜>`, or whose name spans lines, is dropped.
  DeepSeek-V3.2's DSML format (vLLM's deepseek_v32) is not built: that name is refused at start-up.
* minimax_m2 (MiniMax-M2, M2.1, vLLM's minimax_m2_tool_parser): `<minimax:tool_call>\n<invoke name="NAME">\n
  <parameter name="K">V</parameter>\n...</invoke>\n...</minimax:tool_call>`, several invokes a block. A name is
  the text up to the tag's `>`, blanks and one pair of quotes off; an invoke whose name is empty or holds a `<` is
  dropped (to its `</invoke>`), a parameter alike (to its `</parameter>`). A value is its text stripped, typed as
  vLLM's parser types it: "null", "none" or "nil" (any case) is null; else by the types the parameter's schema
  names (its "type" or list of types, its enum values' types, anyOf / oneOf / allOf's), tried integer (int()),
  number (float(), whole numbers as integers), boolean (true/1/yes/on, false/0/no/off), object and array (JSON),
  string (as written), in that order, the first that converts; a parameter the schema does not declare is a
  string; none of its types converting: JSON, else the string. Each parameter goes out whole at its
  `</parameter>`; one cut by `</invoke>` or `</minimax:tool_call>` is dropped, an invoke left open ends at
  `</minimax:tool_call>`. As in vLLM (both its paths), nothing after the first `<minimax:tool_call>` is content:
  text between invokes and after the blocks is dropped, and a block with no call in it gives none.

* kimi_k2 (Kimi-K2, which runs as DeepseekV3ForCausalLM; vLLM's kimi_k2_tool_parser): `<|tool_calls_section_begin|>`
  (or the singular `<|tool_call_section_begin|>` some checkpoints write) then calls
  `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>`, then
  `<|tool_calls_section_end|>`. The name is the id's text before its first `:`, after its last `.`; an id (blanks
  around it off) that does not end in `:IDX`, holds a `<` or gives no name, and a call without the argument tag, are
  dropped. The arguments are the text as generated, blanks around it off (deepseek_v31's streaming); a next call's
  tag or a section's end cuts them. As in vLLM (both its paths), nothing from the first section tag on is content,
  and output without one is all content. The id is the call's id (vLLM's): its "call" event carries it, a fourth
  element the server sends as the call's `id`.

* seed_oss (Seed-OSS, vLLM's seed_oss_tool_parser): qwen3_coder's calls in `<seed:tool_call>` ... `</seed:tool_call>`
  (or bare), the values typed by seed_oss_value (vLLM's older qwen3coder rules, "null" first); a thinking span
  `<seed:think>` ... `</seed:think>` (there when no reasoning parser took it) is content, its calls not read.

As for hermes: text outside the calls is content, blanks next to calls dropped once a call was read; a
block left open at the end counts up to the end, its open value ended there and its object closed; a
call cut before any of its arguments keeps none (nothing invented).
"""

from __future__ import annotations

import ast
import json
import re

from llmc.runtime.server.tool_parsers import BufferedToolParser, Event, ToolParser, _first, _held, _held_prefix


def _json(value) -> str | None:
    """`value` as vLLM's json.dumps writes it, or None when it is not JSON (a set, NaN, bytes)."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None


def _literal(text: str):
    """A Python literal's value; ValueError when the text is not one."""
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise ValueError(text) from None


def _properties(tools: list[dict] | None, name: str) -> dict:
    """The JSON schema properties of the function `name` among the request's tools ({} if none)."""
    for tool in tools or []:
        function = tool.get("function") or {}
        if function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties")
            return properties if isinstance(properties, dict) else {}
    return {}


class _PairsParser(BufferedToolParser):
    """Base of the XML-like formats: content outside calls, one call's arguments written as the JSON
    object of its (key, value) pairs."""

    def __init__(self, tools: list[dict] | None):
        super().__init__()
        self.tools = tools
        self._buffer = ""
        self._index = 0
        self._pairs = 0  # pairs written of the open call

    def _open_call(self, name: str) -> list[Event]:
        self._index, self._pairs = self.num_calls, 0
        return self._count([("call", self._index, name)])

    def _key(self, key: str) -> str:
        """The next pair's start: `{"key": ` or `, "key": `."""
        self._pairs += 1
        return ("{" if self._pairs == 1 else ", ") + json.dumps(key, ensure_ascii=False) + ": "

    def _args(self, text: str) -> list[Event]:
        return [("args", self._index, text)] if text else []

    def _close_call(self, whole: bool) -> list[Event]:
        """The call's end: its object closed; `whole` (the end tag read) writes {} for a call without pairs."""
        return self._args("}" if self._pairs else "{}" if whole else "")

    def _held_content(self, tags: tuple[str, ...], final: bool) -> list[Event]:
        """The buffer as content but what may begin one of `tags` (kept for the next piece)."""
        keep = 0 if final else _held(self._buffer, tags)
        text, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
        return self._content(text)


_BAD_NAME = re.compile(r"""[{}<>"'\s]""")  # not in a function's name (vLLM's qwen3coder rule)


class Glm45ToolParser(_PairsParser):
    START, END = "<tool_call>", "</tool_call>"
    KEY, KEY_END, VALUE, VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
    NAME_ENDS = ("\n", KEY, END)  # what ends the name
    BLANKS: tuple[str, ...] = ()  # text read as blanks around the name and between a key and its value

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self._state = "content"  # content, name, pairs, key, after_key, value
        self._name = ""
        self._key_text = ""
        self._string = False  # the open value is written as a string as it comes
        self._value: list[str] = []  # the open value (not a string) so far

    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            state, buffer = self._state, self._buffer
            if state == "content":
                at = buffer.find(self.START)
                if at < 0:
                    return out + self._held_content((self.START,), final)
                out += self._content(buffer[:at])
                self._buffer, self._state = buffer[at + len(self.START):], "name"
            elif state == "name":
                hit = _first(buffer, self.NAME_ENDS)
                if hit is None and not final:  # the name goes on, unless what came cannot begin one
                    name = buffer[:len(buffer) - _held(buffer, self.NAME_ENDS)]
                    if not _BAD_NAME.search(self._unblank(name, both=True)):
                        return out
                    name = ""
                else:
                    name = "" if hit is None else self._unblank(buffer[:hit[0]], both=True)
                if not name or _BAD_NAME.search(name):  # not a call, or cut in its name: the tag is content
                    # and its text is read again
                    self._state = "content"
                    out += self._content(self.START)
                    continue
                self._name, self._state = name, "pairs"
                self._buffer = buffer[hit[0] + (1 if hit[1] == "\n" else 0):]
                out += self._open_call(name)
            elif state == "pairs":
                hit = _first(buffer, (self.KEY, self.END))
                if hit is None:
                    if final:
                        return out + self._end_call(False)
                    self._buffer = buffer[len(buffer) - _held(buffer, (self.KEY, self.END)):]
                    return out
                self._buffer = buffer[hit[0] + len(hit[1]):]
                if hit[1] == self.END:
                    out += self._end_call(True)
                else:
                    self._state = "key"
            elif state == "key":
                hit = _first(buffer, (self.KEY_END, self.END))
                if hit is None:
                    if final:
                        return out + self._end_call(False)
                    return out
                if hit[1] == self.END:  # a key never closed: dropped, the call ends
                    self._buffer = buffer[hit[0] + len(self.END):]
                    out += self._end_call(True)
                    continue
                self._key_text, self._state = buffer[:hit[0]].strip(), "after_key"
                self._buffer = buffer[hit[0] + len(self.KEY_END):]
            elif state == "after_key":
                rest = self._unblank(buffer)
                if rest.startswith(self.VALUE):
                    self._buffer, self._state = rest[len(self.VALUE):], "value"
                    out += self._start_value()
                elif any(tag.startswith(rest) for tag in (self.VALUE,) + self.BLANKS) and not final:
                    return out  # blanks, maybe the tag
                else:
                    self._state = "pairs"  # the key without a value: dropped
                    if final and not rest:
                        return out + self._end_call(False)
            else:  # value
                hit = _first(buffer, (self.VALUE_END, self.END))
                if hit is None:
                    keep = 0 if final else _held(buffer, (self.VALUE_END, self.END))
                    out += self._value_text(buffer[:len(buffer) - keep])
                    self._buffer = buffer[len(buffer) - keep:]
                    if final:
                        return out + self._end_value() + self._end_call(False)
                    return out
                out += self._value_text(buffer[:hit[0]]) + self._end_value()
                self._buffer, self._state = buffer[hit[0] + len(hit[1]):], "pairs"
                if hit[1] == self.END:  # the value ends with the call
                    out += self._end_call(True)

    def _unblank(self, text: str, both: bool = False) -> str:
        """`text` without its leading blanks (and BLANKS), or both ends' with `both`."""
        while True:
            rest = text.lstrip()
            rest = next((rest[len(tag):] for tag in self.BLANKS if rest.startswith(tag)), rest)
            if rest == text:
                break
            text = rest
        if both:
            while True:
                rest = text.rstrip()
                rest = next((rest[:-len(tag)] for tag in self.BLANKS if rest.endswith(tag)), rest)
                if rest == text:
                    break
                text = rest
        return text

    def _start_value(self) -> list[Event]:
        schema = _properties(self.tools, self._name).get(self._key_text)
        self._string = isinstance(schema, dict) and schema.get("type") == "string"
        self._value = []
        return self._args(self._key(self._key_text) + '"') if self._string else []

    def _value_text(self, text: str) -> list[Event]:
        if self._string:
            return self._args(json.dumps(text, ensure_ascii=False)[1:-1])
        self._value.append(text)
        return []

    def _end_value(self) -> list[Event]:
        if self._string:
            return self._args('"')
        text = "".join(self._value).strip()
        for read in (json.loads, _literal):
            try:
                value = _json(read(text))
            except (ValueError, RecursionError):
                continue
            if value is not None:
                break
        else:
            value = json.dumps(text, ensure_ascii=False)
        return self._args(self._key(self._key_text) + value)

    def _end_call(self, whole: bool) -> list[Event]:
        self._state = "content"
        return self._close_call(whole)


class Glm47ToolParser(Glm45ToolParser):
    """GLM-4.7's calls: glm45's, the name running to the first `<arg_key>` (or `</tool_call>`), and an
    escaped newline (the two characters `\\n`) read as a blank (vLLM's glm47 regexes)."""

    NAME_ENDS = (Glm45ToolParser.KEY, Glm45ToolParser.END)
    BLANKS = ("\\n",)


# vLLM's qwen3coder type names (lower case): kept as written, and read as JSON first
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_NULLS = ("null", "none")


def _type_of(schema) -> tuple[str, bool]:
    """(the parameter's type, whether null is allowed): its "type", or first non-null one of a list of
    types or of an anyOf; "string" when the schema names none."""
    if not isinstance(schema, dict):
        return "string", False
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    elif isinstance(schema.get("anyOf"), list):
        types = [option.get("type") for option in schema["anyOf"] if isinstance(option, dict) and "type" in option]
    else:
        return "string", False
    names = [str(t).strip().lower() for t in types]
    others = [t for t in names if t != "null"]
    return (others[0] if others else "null" if names else "string"), "null" in names


_NOT_SCALAR = object()


def _scalar(text: str, kind: str) -> object:
    """A value of a scalar schema type as vLLM's XML-style parsers (qwen3_coder, seed_oss) convert it: integer types by
    int(), number types by float() (whole numbers as integers), the text where those do not convert; booleans "true"
    (any case; any other text false); _NOT_SCALAR for other types."""
    try:
        if kind.startswith(("int", "uint", "long", "short", "unsigned")):
            return int(text)
        if kind.startswith(("num", "float")):
            number = float(text)
            return int(number) if number == int(number) else number
    except (ValueError, OverflowError):
        return text
    if kind in ("boolean", "bool", "binary"):
        return text.lower() == "true"
    return _NOT_SCALAR


def qwen3_coder_value(text: str, schema) -> object:
    """A Qwen3-Coder parameter's value typed by its JSON schema (None: not declared), as vLLM reads it."""
    if schema is None:
        return text
    kind, nullable = _type_of(schema)
    if (nullable or kind not in _STRING_TYPES) and text.lower() in _NULLS:
        return None
    if kind in _STRING_TYPES:
        return text
    if (value := _scalar(text, kind)) is not _NOT_SCALAR:
        return value
    container = kind in ("object", "array", "arr") or kind.startswith(("dict", "list"))
    if container:
        try:
            value = json.loads(text)
            if isinstance(value, str):  # a Python repr written as a JSON string
                try:
                    value = _literal(value)
                except ValueError:
                    pass
            return value
        except ValueError:
            pass
    try:
        value = _literal(text)
    except ValueError:
        return text
    if container and isinstance(value, str):
        try:
            value = _literal(value)
        except ValueError:
            pass
    return value


class Qwen3CoderToolParser(_PairsParser):
    BLOCK, BLOCK_END = "<tool_call>", "</tool_call>"
    FUNCTION, FUNCTION_END = "<function=", "</function>"
    PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
    THINK, THINK_END = (), ""  # a span of content whose calls are not read (seed_oss: the model's thinking)

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        self._state = "content"  # content, think, block (after <tool_call>), name, body, pname, value, after
        self._opened = ""  # the tags read of a call not known yet (content if it is not one)
        self._name = ""
        self._properties: dict = {}
        self._param = ""

    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            state, buffer = self._state, self._buffer
            if state == "content":
                hit = _first(buffer, (self.BLOCK, self.FUNCTION) + self.THINK)
                if hit is None:
                    return out + self._held_content((self.BLOCK, self.FUNCTION) + self.THINK, final)
                if hit[1] in self.THINK:  # content to the span's end, its tags not read
                    end = hit[0] + len(hit[1])
                    out += self._content(buffer[:end])
                    self._buffer, self._state = buffer[end:], "think"
                    continue
                out += self._content(buffer[:hit[0]])
                self._buffer, self._opened = buffer[hit[0] + len(hit[1]):], hit[1]
                self._state = "block" if hit[1] == self.BLOCK else "name"
            elif state == "think":
                at = buffer.find(self.THINK_END)
                if at < 0:
                    return out + self._held_content((self.THINK_END,), final)
                out += self._content(buffer[:at + len(self.THINK_END)])
                self._buffer, self._state = buffer[at + len(self.THINK_END):], "content"
            elif state == "block":
                rest = buffer.lstrip()
                if rest.startswith(self.FUNCTION):
                    self._buffer, self._state = rest[len(self.FUNCTION):], "name"
                    self._opened += buffer[:len(buffer) - len(rest)] + self.FUNCTION
                elif self.FUNCTION.startswith(rest) and not final:
                    return out
                else:
                    out += self._not_a_call()
            elif state == "name":
                at = buffer.find(">")
                if at < 0 and not final and not _BAD_NAME.search(buffer):
                    return out
                name = buffer[:at] if at >= 0 else ""
                if not name or _BAD_NAME.search(name):
                    out += self._not_a_call()
                    continue
                self._buffer, self._state, self._name = buffer[at + 1:], "body", name
                self._properties = _properties(self.tools, name)
                out += self._open_call(name)
            elif state == "body":
                hit = _first(buffer, (self.PARAMETER, self.FUNCTION_END, self.BLOCK_END))
                if hit is None:
                    if final:
                        return out + self._end_call(False)
                    self._buffer = buffer[len(buffer) - _held(buffer, (self.PARAMETER, self.FUNCTION_END,
                                                                       self.BLOCK_END)):]
                    return out
                self._buffer = buffer[hit[0] + len(hit[1]):]
                if hit[1] == self.PARAMETER:
                    self._state = "pname"
                else:
                    out += self._end_call(True)
                    self._state = "after" if hit[1] == self.FUNCTION_END and self._opened.startswith(self.BLOCK) \
                        else "content"
            elif state == "pname":
                at = buffer.find(">")
                if at < 0:
                    if final:
                        return out + self._end_call(False)
                    return out
                self._param, self._buffer, self._state = buffer[:at], buffer[at + 1:], "value"
            elif state == "value":
                hit = _first(buffer, (self.PARAMETER_END, self.PARAMETER, self.FUNCTION_END, self.BLOCK_END))
                if hit is None and not final:
                    return out
                value = buffer if hit is None else buffer[:hit[0]]
                value = value.removeprefix("\n").removesuffix("\n")
                out += self._pair(value)
                if hit is None:
                    return out + self._end_call(False)
                # only </parameter> is the value's own: the other tags are read on in the body
                self._buffer = buffer[hit[0] + (len(hit[1]) if hit[1] == self.PARAMETER_END else 0):]
                self._state = "body"
            else:  # after: </function> read, the block's </tool_call> (after blanks) goes with it
                rest = buffer.lstrip()
                if rest.startswith(self.BLOCK_END):
                    self._buffer, self._state = rest[len(self.BLOCK_END):], "content"
                elif self.BLOCK_END.startswith(rest) and not final:
                    return out
                else:
                    self._state = "content"

    def _not_a_call(self) -> list[Event]:
        """The tags read are content, the text after them read again."""
        self._state = "content"
        return self._content(self._opened)

    def _pair(self, value: str) -> list[Event]:
        typed = _json(self._typed(value, self._properties.get(self._param)))
        return self._args(self._key(self._param) + (json.dumps(value, ensure_ascii=False) if typed is None else typed))

    def _end_call(self, whole: bool) -> list[Event]:
        self._state = "content"
        return self._close_call(whole)


    @staticmethod
    def _typed(text: str, schema) -> object:
        return qwen3_coder_value(text, schema)


def seed_oss_value(text: str, schema) -> object:
    """A Seed-OSS parameter's value typed by its JSON schema (None: not declared), as vLLM's seed_oss reads it:
    "null" (any case) null whatever the type; undeclared parameters as written; the schema's "type" (a list of
    types: its text, no type named) string-like as written, integer types by int(), number types by float()
    (whole numbers as integers), booleans "true" (any case; any other text false), objects as JSON, else (and
    any other type) a Python literal; a value that does not convert stays the string."""
    if text.lower() == "null":
        return None
    if schema is None:
        return text
    kind = str(schema["type"]).strip().lower() if isinstance(schema, dict) and "type" in schema else "string"
    if kind in _STRING_TYPES:
        return text
    if (value := _scalar(text, kind)) is not _NOT_SCALAR:
        return value
    if kind == "object" or kind.startswith("dict"):
        try:
            return json.loads(text)
        except (ValueError, RecursionError):
            pass
    try:
        return _literal(text)
    except ValueError:
        return text


class SeedOssToolParser(Qwen3CoderToolParser):
    """Seed-OSS's calls: qwen3_coder's, in `<seed:tool_call>` ... `</seed:tool_call>` (or bare `<function=...>`),
    typed by seed_oss_value; a thinking span `<seed:think>` ... `</seed:think>` in the text is content, its calls not
    read (vLLM reads calls after the thinking)."""

    BLOCK, BLOCK_END = "<seed:tool_call>", "</seed:tool_call>"
    THINK, THINK_END = ("<seed:think>",), "</seed:think>"

    @staticmethod
    def _typed(text: str, schema) -> object:
        return seed_oss_value(text, schema)


class DeepSeekV3ToolParser(ToolParser):
    CALLS, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    FENCE = "```"
    TYPED = True  # a call is TYPE<｜tool▁sep｜>NAME then the arguments in ```json fences (else NAME<｜tool▁sep｜>ARGS)

    def __init__(self):
        super().__init__()
        self._buffer = ""
        self._state = "content"  # content, section, type, name, fence, args, skip (a call dropped)
        self._index = 0
        self._raw = ""  # the open call's arguments as generated
        self._sent = 0

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        return self._run(final=True) + self._end_content()

    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            state, buffer = self._state, self._buffer
            if state == "content":
                at = buffer.find(self.CALLS)
                if at < 0:
                    keep = 0 if final else _held_prefix(buffer, self.CALLS)
                    self._buffer = buffer[len(buffer) - keep:]
                    return out + self._content(buffer[:len(buffer) - keep])
                out += self._content(buffer[:at])
                self._buffer, self._state = buffer[at + len(self.CALLS):], "section"
            elif state in ("section", "skip"):  # between calls (skip: inside one dropped)
                tags = (self.CALL, self.CALLS_END) if state == "section" else (self.CALL_END, self.CALLS_END)
                hit = _first(buffer, tags)
                if hit is None:
                    self._buffer = "" if final else buffer[len(buffer) - _held(buffer, tags):]
                    return out
                self._buffer = buffer[hit[0] + len(hit[1]):]
                self._state = {self.CALL: "type" if self.TYPED else "name", self.CALL_END: "section",
                               self.CALLS_END: "content"}[hit[1]]
            elif state == "type":
                hit = _first(buffer, (self.SEP, self.CALL_END, self.CALLS_END))
                if hit is None:
                    self._buffer = "" if final else buffer
                    return out
                if hit[1] != self.SEP:  # no name: the call is dropped
                    self._state = "skip"
                    continue
                self._buffer, self._state = buffer[hit[0] + len(self.SEP):], "name"
            elif state == "name":
                ends = ("\n", self.FENCE) if self.TYPED else (self.SEP,)
                hit = _first(buffer, ends + (self.CALL_END, self.CALLS_END))
                if hit is None:  # the name goes on (or was cut: no call)
                    self._buffer = "" if final else buffer
                    return out
                name = buffer[:hit[0]].strip()
                if not name or hit[1] in (self.CALL_END, self.CALLS_END) and not self.TYPED or "\n" in name:
                    self._state = "skip"  # no name, or (V3.1) no separator: the call is dropped
                    continue
                self._buffer = buffer[hit[0] + (0 if hit[1] in (self.FENCE, self.CALL_END, self.CALLS_END)
                                                else len(hit[1])):]
                self._index, self._raw, self._sent = self.num_calls, "", 0
                self._state = "fence" if self.TYPED else "args"
                out += self._count([("call", self._index, name)])
            elif state == "fence":  # ```json before the arguments, if there
                rest, opening = buffer.lstrip(), self.FENCE + "json"
                if opening.startswith(rest) and len(rest) < len(opening) and not final:
                    return out  # blanks, or maybe the fence
                for tag in (opening, self.FENCE, ""):
                    if rest.startswith(tag):
                        self._buffer = rest[len(tag):]
                        break
                self._state = "args"
            else:  # args
                hit = _first(buffer, (self.CALL_END, self.CALLS_END))
                if hit is None:
                    keep = 0 if final else _held(buffer, (self.CALL_END, self.CALLS_END))
                    self._raw += buffer[:len(buffer) - keep]
                    self._buffer = buffer[len(buffer) - keep:]
                    if final:
                        return out + self._args(done=True)
                    return out + self._args(done=False)
                self._raw += buffer[:hit[0]]
                out += self._args(done=True)
                self._buffer = buffer[hit[0] + len(hit[1]):]
                self._state = "section" if hit[1] == self.CALL_END else "content"

    def _args(self, done: bool) -> list[Event]:
        """The arguments' new text: while open, up to what may be the closing fence; at the end, the
        text without that fence and the blanks around it."""
        raw = self._raw.lstrip()
        if done:
            text = raw.rstrip()
            text = text.removesuffix(self.FENCE).rstrip() if self.TYPED and text.endswith(self.FENCE) else text
        else:
            end = len(raw)
            while end and (raw[end - 1].isspace() or self.TYPED and raw[end - 1] == "`"):
                end -= 1
            text = raw[:end]
        piece, self._sent = text[self._sent:], max(self._sent, len(text))
        return [("args", self._index, piece)] if piece else []


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    """DeepSeek-V3.1's (and V3.2-Exp's) calls: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`,
    no type and no fences (vLLM's deepseekv31_tool_parser)."""

    TYPED = False


class KimiK2ToolParser(DeepSeekV31ToolParser):
    """Kimi-K2's calls (vLLM's kimi_k2_tool_parser): content up to the first section tag, then calls
    `<|tool_call_begin|>ID<|tool_call_argument_begin|>ARGS<|tool_call_end|>`, the arguments as written."""

    SECTIONS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")  # vLLM reads both spellings
    SECTION_ENDS = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
    CALL, CALL_END, SEP = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"
    _ID = re.compile(r"[^<]+:\d+")  # vLLM's: functions.NAME:IDX (or NAME:IDX), the name before the first ":"

    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            state, buffer = self._state, self._buffer
            if state == "content":
                hit = _first(buffer, self.SECTIONS)
                if hit is None:
                    keep = 0 if final else _held(buffer, self.SECTIONS)
                    self._buffer = buffer[len(buffer) - keep:]
                    return out + self._content(buffer[:len(buffer) - keep])
                out += self._content(buffer[:hit[0]])
                self._buffer, self._state = buffer[hit[0] + len(hit[1]):], "section"
            elif state in ("section", "skip"):  # between calls (skip: in one dropped), text dropped
                tags = (self.CALL,) if state == "section" else (self.CALL, self.CALL_END)
                hit = _first(buffer, tags)
                if hit is None:
                    self._buffer = "" if final else buffer[len(buffer) - _held(buffer, tags):]
                    return out
                self._buffer = buffer[hit[0] + len(hit[1]):]
                self._state = "name" if hit[1] == self.CALL else "section"
            elif state == "name":
                hit = _first(buffer, (self.SEP, self.CALL, self.CALL_END))
                if hit is None:  # the id goes on (or was cut: no call)
                    self._buffer = "" if final else buffer
                    return out
                call_id = buffer[:hit[0]].strip()
                name = call_id.split(":")[0].split(".")[-1]
                if hit[1] != self.SEP or not self._ID.fullmatch(call_id) or not name:
                    self._buffer = buffer[hit[0]:]  # no id or no arguments: the call is dropped
                    self._state = "skip"
                    continue
                self._buffer, self._state = buffer[hit[0] + len(self.SEP):], "args"
                self._index, self._raw, self._sent = self.num_calls, "", 0
                out += self._count([("call", self._index, name, call_id)])  # the call's id: the model's
            else:  # args: to the call's end (a section's end or a next call cuts it)
                ends = (self.CALL_END, self.CALL) + self.SECTION_ENDS
                hit = _first(buffer, ends)
                if hit is None:
                    keep = 0 if final else _held(buffer, ends)
                    self._raw += buffer[:len(buffer) - keep]
                    self._buffer = buffer[len(buffer) - keep:]
                    return out + self._args(done=final)
                self._raw += buffer[:hit[0]]
                out += self._args(done=True)
                self._buffer = buffer[hit[0] + (len(hit[1]) if hit[1] == self.CALL_END else 0):]
                self._state = "section"


_MINIMAX_NULLS = ("null", "none", "nil")
# vLLM's minimax_m2 order of trying a parameter's types (the first that converts wins)
_MINIMAX_ORDER = ("integer", "int", "number", "float", "boolean", "bool", "object", "array", "string", "str", "text")
_JSON_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
               (dict, "object"))


def _minimax_types(schema) -> set[str]:
    """The type names a MiniMax-M2 parameter's schema allows: its "type" (or list of them), its enum values' JSON
    types (null for None), and those of its anyOf / oneOf / allOf choices; {"string"} when it names none."""
    if not isinstance(schema, dict):
        return {"string"}
    types: set[str] = set()
    kind = schema.get("type")
    types |= {kind} if isinstance(kind, str) else {t for t in kind if isinstance(t, str)} if isinstance(kind, list) \
        else set()
    for value in schema.get("enum") or [] if isinstance(schema.get("enum"), list) else []:
        types.add("null" if value is None else next(name for cls, name in _JSON_TYPES if isinstance(value, cls)))
    for choices in (schema.get(key) for key in ("anyOf", "oneOf", "allOf")):
        for choice in choices if isinstance(choices, list) else []:
            types |= _minimax_types(choice)
    return types or {"string"}


def minimax_m2_value(text: str, schema) -> object:
    """A MiniMax-M2 parameter's value (its text stripped) typed by its JSON schema (None: not declared), as vLLM
    reads it."""
    if text.lower() in _MINIMAX_NULLS:
        return None
    types = {t.lower() for t in _minimax_types(schema)}
    for kind in (t for t in _MINIMAX_ORDER if t in types):
        if kind in ("string", "str", "text"):
            return text
        try:
            if kind in ("integer", "int"):
                return int(text)
            if kind in ("number", "float"):
                number = float(text)
                return number if number != int(number) else int(number)
        except (ValueError, OverflowError):
            continue
        if kind in ("boolean", "bool"):
            word = text.strip().lower()
            if word in ("true", "1", "yes", "on", "false", "0", "no", "off"):
                return word in ("true", "1", "yes", "on")
            continue
        try:
            return json.loads(text)
        except (ValueError, RecursionError):
            continue
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def _unquoted(name: str) -> str:
    """A tag's name attribute: blanks and one pair of matching quotes off."""
    name = name.strip()
    return name[1:-1] if len(name) >= 2 and name[0] == name[-1] and name[0] in "\"'" else name


class MiniMaxM2ToolParser(_PairsParser):
    BLOCK, BLOCK_END = "<minimax:tool_call>", "</minimax:tool_call>"
    INVOKE, INVOKE_END = "<invoke name=", "</invoke>"
    PARAMETER, PARAMETER_END = "<parameter name=", "</parameter>"

    def __init__(self, tools: list[dict] | None = None):
        super().__init__(tools)
        # content (before any block), outside (after one), block, name, body, pname, value, skip_invoke, skip_param
        self._state = "content"
        self._properties: dict = {}
        self._param = ""

    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            state, buffer = self._state, self._buffer
            if state == "content":
                at = buffer.find(self.BLOCK)
                if at < 0:
                    return out + self._held_content((self.BLOCK,), final)
                out += self._content(buffer[:at])
                self._buffer, self._state = buffer[at + len(self.BLOCK):], "block"
            elif state in ("name", "pname"):  # the name runs to the tag's ">"
                at = buffer.find(">")
                raw = buffer if at < 0 else buffer[:at]
                skip = "skip_invoke" if state == "name" else "skip_param"
                if "<" in raw:  # a tag before the name's end: no name, the tag read on
                    self._state = skip
                    continue
                if at < 0:  # the name goes on, or (at the end) was cut: no call, no parameter
                    if final and state == "pname":
                        self._state = skip
                        continue
                    return out
                name, self._buffer = _unquoted(raw), buffer[at + 1:]
                if not name:
                    self._state = skip
                elif state == "name":
                    self._state, self._properties = "body", _properties(self.tools, name)
                    out += self._open_call(name)
                else:
                    self._state, self._param = "value", name
            elif state == "value":
                hit = _first(buffer, (self.PARAMETER_END, self.INVOKE_END, self.BLOCK_END))
                if hit is None:
                    if final:
                        return out + self._pair(buffer) + self._close_call(False)
                    return out
                if hit[1] == self.PARAMETER_END:
                    out += self._pair(buffer[:hit[0]])
                    self._buffer = buffer[hit[0] + len(hit[1]):]
                else:  # cut by the invoke's or the block's end: dropped, the tag read in the body
                    self._buffer = buffer[hit[0]:]
                self._state = "body"
            else:  # between tags: what ends the state, the text before it dropped
                tags = {"outside": (self.BLOCK,), "block": (self.INVOKE, self.BLOCK_END),
                        "body": (self.PARAMETER, self.INVOKE_END, self.BLOCK_END),
                        "skip_invoke": (self.INVOKE_END, self.BLOCK_END),
                        "skip_param": (self.PARAMETER_END, self.INVOKE_END, self.BLOCK_END)}[state]
                hit = _first(buffer, tags)
                if hit is None:
                    self._buffer = "" if final else buffer[len(buffer) - _held(buffer, tags):]
                    if final and state in ("body", "skip_param"):
                        out += self._close_call(False)
                    return out
                end = hit[0] + len(hit[1])
                if hit[1] == self.BLOCK_END:
                    out += self._close_call(True) if state in ("body", "skip_param") else []
                    self._buffer, self._state = buffer[end:], "outside"
                elif hit[1] == self.INVOKE_END:
                    out += self._close_call(True) if state in ("body", "skip_param") else []
                    self._buffer, self._state = buffer[end:], "block"
                else:
                    self._buffer = buffer[end:]
                    self._state = {self.BLOCK: "block", self.INVOKE: "name", self.PARAMETER: "pname",
                                   self.PARAMETER_END: "body"}[hit[1]]

    def _pair(self, text: str) -> list[Event]:
        value = text.strip()
        typed = _json(minimax_m2_value(value, self._properties.get(self._param)))
        return self._args(self._key(self._param) + (json.dumps(value, ensure_ascii=False) if typed is None else typed))
