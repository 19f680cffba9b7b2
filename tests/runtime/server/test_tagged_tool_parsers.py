"""The glm45, glm47, qwen3_coder, deepseek_v3, deepseek_v31 and minimax_m2 tool call parsers and the glm45 reasoning
parser, on texts written by hand from the published formats (GLM-4.5's chat template: `<tool_call>NAME\\n
<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>`; GLM-4.7's: `<tool_call>NAME<arg_key>K</arg_key>
<arg_value>V</arg_value></tool_call>`; Qwen3-Coder's: `<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV
\\n</parameter>\\n</function>\\n</tool_call>`; DeepSeek-V3's: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function
<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>`; DeepSeek-V3.1's:
`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜><｜tool▁calls▁end｜>`; MiniMax-M2's
tool calling guide: `<minimax:tool_call>\n<invoke name="NAME">\n<parameter name="K">V</parameter>\n</invoke>\n
</minimax:tool_call>`) and vLLM's
documented rules for typing the values by the request's tool schemas. Every text is also streamed split at every character
boundary, one character at a time and in random pieces: the joined pieces must give the same content
and calls, and every call's arguments are JSON whose value is checked."""

from __future__ import annotations

import json
import random

import pytest

from llmc.runtime.server import reasoning_parsers
from llmc.runtime.server.serving import ServingContext
from llmc.runtime.server.tagged_tool_parsers import minimax_m2_value, qwen3_coder_value, seed_oss_value
from llmc.runtime.server.tool_parsers import TOOL_CALL_PARSERS, fold, make_parser, parse

PROPERTIES = {"city": {"type": "string"}, "days": {"type": "integer"}, "ratio": {"type": "number"},
              "metric": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": "array"},
              "unit": {"type": ["string", "null"]}, "note": {"anyOf": [{"type": "null"}, {"type": "string"}]},
              "any": {}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
                                                                                 "properties": PROPERTIES}}},
         {"type": "function", "function": {"name": "ping"}}]

GLM45 = [
    # (text, content, [(name, arguments as a value)])
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
     "<arg_value>3</arg_value>\n</tool_call>", "", [("get_weather", {"city": "Paris", "days": 3})]),
    # content before, two calls, a call without arguments; values that are not strings read as JSON
    ('Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Lyon "2"\n</arg_value>\n'
     '<arg_key>opts</arg_key>\n<arg_value>{"a": [1, true, null]}</arg_value>\n<arg_key>ratio</arg_key>\n'
     "<arg_value> 0.5 </arg_value>\n</tool_call>\n<tool_call>ping\n</tool_call>", "Let me check.",
     [("get_weather", {"city": 'Lyon "2"\n', "opts": {"a": [1, True, None]}, "ratio": 0.5}), ("ping", {})]),
    # a string parameter keeps a number-like value as written; others: JSON, else a Python literal, else the text
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>123</arg_value><arg_key>metric</arg_key>"
     "<arg_value>True</arg_value><arg_key>tags</arg_key><arg_value>['a', 'b']</arg_value><arg_key>any</arg_key>"
     "<arg_value>hello world</arg_value></tool_call>", "",
     [("get_weather", {"city": "123", "metric": True, "tags": ["a", "b"], "any": "hello world"})]),
    # a function the tools do not declare: every value read as JSON where it is JSON
    ("<tool_call>other\n<arg_key>x</arg_key>\n<arg_value>7</arg_value>\n<arg_key>y</arg_key>\n<arg_value>seven"
     "</arg_value>\n</tool_call> Done.", " Done.", [("other", {"x": 7, "y": "seven"})]),
    # cut in a string value (max_tokens): the call stands with what was written, its object closed
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par", "", [("get_weather", {"city": "Par"})]),
    ("<tool_call>get_weather\n<arg_key>days</arg_key>\n<arg_value>4", "", [("get_weather", {"days": 4})]),
    # cut before any argument: none invented
    ("<tool_call>get_weather\n<arg_key>ci", "", [("get_weather", None)]),
    # a key without a value is dropped; text between pairs is ignored
    ("<tool_call>get_weather\n<arg_key>city</arg_key> oops <arg_key>days</arg_key>\n<arg_value>2</arg_value>"
     "</tool_call>", "", [("get_weather", {"days": 2})]),
    # no name, or cut in it: not a call, the text comes back
    ("<tool_call></tool_call>ok", "<tool_call></tool_call>ok", []),
    ('<tool_call>{"name": "f"}</tool_call>', '<tool_call>{"name": "f"}</tool_call>', []),
    ("Hi <tool_call>get_wea", "Hi <tool_call>get_wea", []),
    ("No call: a < b, <tool and </tool_call>.\n", "No call: a < b, <tool and </tool_call>.\n", []),
    ("", "", []),
]

GLM47 = [
    # GLM-4.7's template: the first <arg_key> right after the name, no newlines
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days</arg_key>"
     "<arg_value>3</arg_value></tool_call>", "", [("get_weather", {"city": "Paris", "days": 3})]),
    # content before and after, a call without arguments, GLM-4.5's newlines read too
    ("Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Lyon</arg_value>\n</tool_call>"
     "<tool_call>ping</tool_call> Done.", "Let me check.\n Done.", [("get_weather", {"city": "Lyon"}), ("ping", {})]),
    # an escaped newline (the two characters) reads as a blank around the name and between a key and its value
    ("<tool_call>get_weather\\n<arg_key>days</arg_key>\\n \\n<arg_value>2</arg_value>\\n<arg_key>city</arg_key>"
     "<arg_value>Oslo</arg_value></tool_call>", "", [("get_weather", {"days": 2, "city": "Oslo"})]),
    # other text there drops the key; a name over two lines is not one (the text comes back)
    ("<tool_call>ping<arg_key>a</arg_key>\\t<arg_value>1</arg_value></tool_call>", "", [("ping", {})]),
    ("<tool_call>get\nweather<arg_key>x</arg_key><arg_value>1</arg_value></tool_call>",
     "<tool_call>get\nweather<arg_key>x</arg_key><arg_value>1</arg_value></tool_call>", []),
    # a tag in prose: content, the text after it read again
    ("Use <tool_call> like so: <tool_call>ping</tool_call>", "Use <tool_call> like so:", [("ping", {})]),
    # cut in a value: what was written; cut in the name: not a call
    ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Ro", "", [("get_weather", {"city": "Ro"})]),
    ("<tool_call>get_weather\n", "<tool_call>get_weather\n", []),
]

QWEN3_CODER = [
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
     "</parameter>\n</function>\n</tool_call>", "", [("get_weather", {"city": "Paris", "days": 3})]),
    # content before, two calls, one without parameters
    ("I will look.\n<tool_call>\n<function=get_weather>\n<parameter=ratio>\n2.0\n</parameter>\n<parameter=metric>\n"
     "False\n</parameter>\n<parameter=opts>\n{\"k\": [1, 2]}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
     "<function=ping>\n</function>\n</tool_call>", "I will look.",
     [("get_weather", {"ratio": 2, "metric": False, "opts": {"k": [1, 2]}}), ("ping", {})]),
    # a multi-line string value keeps its inner newlines (one at each end goes); nullable types read null
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\n\nline 1\nline 2\n\n</parameter>\n<parameter=unit>\n"
     "null\n</parameter>\n<parameter=note>\nNone\n</parameter>\n<parameter=days>\nnull\n</parameter>\n</function>\n"
     "</tool_call>", "", [("get_weather", {"city": "\nline 1\nline 2\n", "unit": None, "note": None, "days": None})]),
    # undeclared parameters and undeclared functions: strings as written; a value that does not convert stays text
    ("<tool_call>\n<function=get_weather>\n<parameter=extra>\n5\n</parameter>\n<parameter=days>\nthree\n</parameter>\n"
     "</function>\n</tool_call>", "", [("get_weather", {"extra": "5", "days": "three"})]),
    ("<function=other>\n<parameter=n>\n5\n</parameter>\n</function> after", " after", [("other", {"n": "5"})]),
    # a parameter left open ends at the next one or at </function>
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n<parameter=days>\n2\n</function>\n</tool_call>",
     "", [("get_weather", {"city": "Rome", "days": 2})]),
    # cut inside a value: it ends there, the object closed; cut before any parameter: none invented
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOsl", "", [("get_weather", {"city": "Osl"})]),
    ("<tool_call>\n<function=get_weather>\n<para", "", [("get_weather", None)]),
    # not a call: no function, a name that is not one, cut before the name's end
    ("<tool_call>\nhello\n</tool_call>", "<tool_call>\nhello\n</tool_call>", []),
    ("<tool_call>\n<function={{ name }}>\n</function>\n</tool_call>",
     "<tool_call>\n<function={{ name }}>\n</function>\n</tool_call>", []),
    ("x <function=get_wea", "x <function=get_wea", []),
    ("Use a < b and <tool_ here.", "Use a < b and <tool_ here.", []),
]

B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
C, CE, S = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DEEPSEEK_V3 = [
    (f'{B}{C}function{S}get_weather\n```json\n{{"city": "Paris", "days": 3}}\n```{CE}{E}', "",
     [("get_weather", '{"city": "Paris", "days": 3}')]),
    (f'Let me look.{B}{C}function{S}get_weather\n```json\n{{"city": "a```b"}}\n```{CE}\n{C}function{S}ping\n'
     f"```json\n{{}}\n```{CE}{E}", "Let me look.", [("get_weather", '{"city": "a```b"}'), ("ping", "{}")]),
    # JSON over several lines (vLLM's regex wants it on one), no fences
    (f'{B}{C}function{S}f\n```json\n{{\n  "a": [1,\n 2]\n}}\n```{CE}{E}', "", [("f", '{\n  "a": [1,\n 2]\n}')]),
    (f'{B}{C}function{S}f\n{{"a": 1}}{CE}{E}', "", [("f", '{"a": 1}')]),
    # text after the section is content (its leading blanks too, as hermes')
    (f'{B}{C}function{S}f\n```json\n{{}}\n```{CE}{E}\nDone.', "\nDone.", [("f", "{}")]),
    # cut in the arguments: what was written; cut in the name: no call
    (f'{B}{C}function{S}f\n```json\n{{"a": "x', "", [("f", '{"a": "x')]),
    (f"{B}{C}function{S}get_wea", "", []),
    # the section is never content (vLLM's): a call without a name is dropped
    (f"x{B}{C}function{CE}{E}y", "xy", []),
    ("Plain text with <｜tool▁ in it.", "Plain text with <｜tool▁ in it.", []),
]

DEEPSEEK_V31 = [
    (f'{B}{C}get_weather{S}{{"city": "Paris", "days": 3}}{CE}{E}', "", [("get_weather", '{"city": "Paris", "days": 3}')]),
    (f'Let me look.{B}{C}get_weather{S}{{"city": "a```b"}}{CE}\n{C}ping{S}{{}}{CE}{E}', "Let me look.",
     [("get_weather", '{"city": "a```b"}'), ("ping", "{}")]),
    # the arguments as written (over several lines too), blanks around them off; text after the section: content
    (f'{B}{C} f {S} {{\n  "a": [1,\n 2]\n}}\n{CE}{E}\nDone.', "\nDone.", [("f", '{\n  "a": [1,\n 2]\n}')]),
    # cut in the arguments: what was written; cut in the name: no call
    (f'{B}{C}f{S}{{"a": "x', "", [("f", '{"a": "x')]),
    (f"{B}{C}get_wea", "", []),
    # the section is never content: a call without a separator, or whose name has a newline, is dropped
    (f"x{B}{C}f{CE}{C}a\nb{S}{{}}{CE}{C}g{S}{{}}{CE}{E}y", "xy", [("g", "{}")]),
    ("Plain text with <｜tool▁ in it.", "Plain text with <｜tool▁ in it.", []),
]


# Kimi-K2's chat template and tool calling guide: a section of calls ID<|tool_call_argument_begin|>ARGS, ID being
# functions.NAME:IDX; vLLM's kimi_k2 reads the name before the ":" after the last ".", the arguments as written
KB, KE, KS, KSE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_section_begin|>", \
    "<|tool_call_section_end|>"
KC, KCE, KA = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"
KIMI_K2 = [
    (f'{KB}{KC}functions.get_weather:0{KA}{{"city": "Paris", "days": 3}}{KCE}{KE}', "",
     [("get_weather", '{"city": "Paris", "days": 3}')]),
    (f'Let me look.\n{KB}\n{KC} functions.get_weather:0 {KA} {{"city": "a<b"}} {KCE}\n{KC}ping:1{KA}{{}}{KCE}\n{KE}',
     "Let me look.", [("get_weather", '{"city": "a<b"}'), ("ping", "{}")]),
    # the singular spelling some checkpoints write; arguments over several lines as written
    (f'{KS}{KC}functions.f:0{KA}{{\n  "a": [1,\n 2]\n}}{KCE}{KSE}', "", [("f", '{\n  "a": [1,\n 2]\n}')]),
    # as vLLM: nothing from the section on is content (text between calls and after the section dropped)
    (f"x {KB}junk{KC}functions.f:0{KA}{{}}{KCE} more {KE} after", "x", [("f", "{}")]),
    # an id without its :IDX, with no name, or a call without the argument tag: dropped
    (f"{KB}{KC}functions.f{KA}{{}}{KCE}{KC}functions.:0{KA}{{}}{KCE}{KC}g:0{KCE}{KC}h:2{KA}{{}}{KCE}{KE}", "",
     [("h", "{}")]),
    # cut in the arguments: what was written; cut in the id: no call; a call cut by the next one keeps its text
    (f'{KB}{KC}functions.f:0{KA}{{"a": "x', "", [("f", '{"a": "x')]),
    (f"{KB}{KC}functions.get_wea", "", []),
    (f'{KB}{KC}f:0{KA}{{"a": 1{KC}g:1{KA}{{}}{KCE}', "", [("f", '{"a": 1'), ("g", "{}")]),
    # calls without the section tag are not read (vLLM's check): all content, exactly
    (f"{KC}f:0{KA}{{}}{KCE}", f"{KC}f:0{KA}{{}}{KCE}", []),
    ("Plain text with <|tool_calls_ in it.", "Plain text with <|tool_calls_ in it.", []),
]

# Seed-OSS's chat template: qwen3_coder's calls in <seed:tool_call> ... </seed:tool_call>, values typed by vLLM's
# seed_oss rules (seed_oss_value)
SB, SE = "<seed:tool_call>", "</seed:tool_call>"
SEED_OSS = [
    (f"{SB}\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
     f"</function>\n{SE}", "", [("get_weather", {"city": "Paris", "days": 3})]),
    # content before, two calls, one without parameters; objects as JSON, whole numbers as integers, booleans
    (f'Let me check.\n{SB}\n<function=get_weather>\n<parameter=opts>\n{{"a": [1, true]}}\n</parameter>\n'
     f"<parameter=ratio>\n2.0\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n</function>\n{SE}\n{SB}\n"
     f"<function=ping>\n</function>\n{SE}", "Let me check.",
     [("get_weather", {"opts": {"a": [1, True]}, "ratio": 2, "metric": True}), ("ping", {})]),
    # seed_oss's own rules: "null" null even for a string; an array as a Python literal only (JSON's true is not
    # one: the text stays); a list of types read as a literal; an undeclared parameter as written
    (f"{SB}<function=get_weather><parameter=city>NULL</parameter><parameter=tags>[1, true]</parameter>"
     f"<parameter=unit>5</parameter><parameter=x>7</parameter></function>{SE}", "",
     [("get_weather", {"city": None, "tags": "[1, true]", "unit": 5, "x": "7"})]),
    (f"{SB}<function=get_weather><parameter=tags>['a', 2]</parameter><parameter=days>2.5</parameter></function>{SE}",
     "", [("get_weather", {"tags": ["a", 2], "days": "2.5"})]),
    # a call without the block tags (vLLM's fallback); a thinking span's calls are not read, its text is content
    ("<function=ping>\n</function>", "", [("ping", {})]),
    (f"<seed:think>Maybe {SB}<function=ping></function>{SE}?</seed:think>\n{SB}<function=get_weather>"
     f"<parameter=days>1</parameter></function>{SE}", f"<seed:think>Maybe {SB}<function=ping></function>{SE}?"
     "</seed:think>", [("get_weather", {"days": 1})]),
    (f"<seed:think>cut {SB}<function=ping>", f"<seed:think>cut {SB}<function=ping>", []),
    # cut in a value: what was written; cut before any parameter: none invented
    (f"{SB}\n<function=get_weather>\n<parameter=days>\n4", "", [("get_weather", {"days": 4})]),
    (f"{SB}\n<function=get_weather>\n", "", [("get_weather", None)]),
    # not a call: the text comes back
    (f"{SB}\n<function=a b>\n</function>{SE}", f"{SB}\n<function=a b>\n</function>{SE}", []),
    ("No call: <seed:tool and </seed:tool_call>.\n", "No call: <seed:tool and </seed:tool_call>.\n", []),
]

MB, ME = "<minimax:tool_call>", "</minimax:tool_call>"
MINIMAX_M2 = [
    # MiniMax's guide: content before, two invokes in one block, values typed by the schema
    (f'Let me check.\n{MB}\n<invoke name="get_weather">\n<parameter name="city">San Francisco</parameter>\n'
     f'<parameter name="days">3</parameter>\n</invoke>\n<invoke name="get_weather">\n<parameter name="city">Lyon'
     f'</parameter>\n<parameter name="metric">yes</parameter>\n</invoke>\n{ME}', "Let me check.",
     [("get_weather", {"city": "San Francisco", "days": 3}), ("get_weather", {"city": "Lyon", "metric": True})]),
    # a call without parameters; single quotes; values stripped; JSON containers; null; an undeclared parameter and
    # a function the tools do not declare: strings
    (f"{MB}<invoke name='ping'></invoke><invoke name=\"get_weather\"><parameter name='opts'> {{\"a\": [1, null]}} "
     f'</parameter><parameter name="tags">["x"]</parameter><parameter name="unit">None</parameter><parameter '
     f'name="extra">7</parameter></invoke><invoke name="other"><parameter name="n">7</parameter></invoke>{ME}', "",
     [("ping", {}), ("get_weather", {"opts": {"a": [1, None]}, "tags": ["x"], "unit": None, "extra": "7"}),
      ("other", {"n": "7"})]),
    # nothing after the first block is content (vLLM's), calls in a later block count, text between invokes dropped
    (f'A\n{MB}<invoke name="ping"></invoke> chatter {ME} after\n{MB}<invoke name="ping">x</invoke>{ME}tail', "A",
     [("ping", {}), ("ping", {})]),
    # a block with no call gives none and is not content
    (f"Hi {MB}just text{ME} bye", "Hi ", []),  # (no call read: the blank before the block stays)
    # cut in a value (max_tokens): the call stands with it; cut before any parameter or in a name: nothing invented
    (f'{MB}<invoke name="get_weather"><parameter name="days">1', "", [("get_weather", {"days": 1})]),
    (f'{MB}<invoke name="get_weather"><parameter name="da', "", [("get_weather", None)]),
    (f'{MB}<invoke name="get_wea', "", []),
    # a parameter cut by </invoke> is dropped; an invoke left open ends at the block's end; no name: dropped
    (f'{MB}<invoke name="get_weather"><parameter name="city">Paris</parameter><parameter name="days">2</invoke>'
     f'<invoke name="ping"><parameter name="x">1</parameter>{ME}', "",
     [("get_weather", {"city": "Paris"}), ("ping", {"x": "1"})]),
    (f'{MB}<invoke name="">\n<parameter name="x">1</parameter></invoke><invoke name="a<b"></invoke>'
     f'<invoke name="ping"><parameter name=>2</parameter><parameter name="y>3</parameter></invoke>{ME}', "",
     [("ping", {'"y': "3"})]),  # (an unmatched quote stays in the name, as vLLM reads it)
    ("No call: a < b, <minimax:tool and </invoke>.\n", "No call: a < b, <minimax:tool and </invoke>.\n", []),
    ("", "", []),
]


def _events(kind: str, pieces: list[str]) -> list:
    parser = make_parser(kind, tools=TOOLS)
    return [e for piece in pieces for e in parser.feed(piece)] + parser.finish()


def _check(kind: str, text: str, content: str, calls: list) -> None:
    whole = parse(make_parser(kind, tools=TOOLS), text)
    as_written = kind.startswith("deepseek") or kind == "kimi_k2"  # arguments as generated: compared as text
    got_calls = whole[1] if as_written else [(name, json.loads(args) if args else None) for name, args in whole[1]]
    assert (whole[0], got_calls) == (content, calls)
    for cut in range(len(text) + 1):
        assert fold(_events(kind, [text[:cut], text[cut:]])) == whole, cut
    assert fold(_events(kind, list(text))) == whole
    rng = random.Random(len(text))
    for _ in range(5):
        cuts = sorted(rng.sample(range(len(text) + 1), min(4, len(text) + 1)))
        assert fold(_events(kind, [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])])) == whole


@pytest.mark.parametrize(("kind", "text", "content", "calls"),
                         [("glm45", *case) for case in GLM45] + [("glm47", *case) for case in GLM47]
                         + [("qwen3_coder", *case) for case in QWEN3_CODER] + [("deepseek_v3", *case) for case in DEEPSEEK_V3]
                         + [("deepseek_v31", *case) for case in DEEPSEEK_V31]
                         + [("minimax_m2", *case) for case in MINIMAX_M2] + [("kimi_k2", *case) for case in KIMI_K2]
                         + [("seed_oss", *case) for case in SEED_OSS])
def test_parser(kind, text, content, calls):
    _check(kind, text, content, calls)


def test_glm45_arguments_are_vllm_s_json_dumps():
    """The arguments text is json.dumps of the pairs (", " and ": ", non-ASCII as is), as vLLM writes it."""
    text = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Zürich</arg_value>\n<arg_key>days</arg_key>\n" \
           "<arg_value>2</arg_value>\n</tool_call>"
    assert parse(make_parser("glm45", tools=TOOLS), text)[1] == [("get_weather", '{"city": "Zürich", "days": 2}')]
    # without the request's tools every value is read as JSON first (vLLM's rule)
    assert parse(make_parser("glm45"), text.replace("Zürich", "12"))[1] == [("get_weather", '{"city": 12, "days": 2}')]


def test_glm45_streams_string_values_as_they_come():
    parser = make_parser("glm45", tools=TOOLS)
    assert parser.feed("Hi <tool_call>get_weather\n") == [("content", "Hi"), ("call", 0, "get_weather")]
    assert parser.feed("<arg_key>city</arg_key><arg_value>Pa") == [("args", 0, '{"city": "Pa')]
    assert parser.feed('ris "</arg_') == [("args", 0, 'ris \\"')]  # what may be </arg_value> waits
    assert parser.feed("value><arg_key>days</arg_key><arg_value>1") == [("args", 0, '"')]
    assert parser.feed("2</arg_value></tool_call>") == [("args", 0, ', "days": 12}')]
    assert parser.finish() == [] and parser.called


def test_qwen3_coder_values_are_typed_as_vllm_does():
    assert qwen3_coder_value("5", None) == "5"  # not declared
    assert qwen3_coder_value("5", {"type": "string"}) == "5"
    assert qwen3_coder_value("null", {"type": "string"}) == "null"
    assert qwen3_coder_value("None", {"type": ["string", "null"]}) is None
    assert qwen3_coder_value("NULL", {"type": "integer"}) is None
    assert qwen3_coder_value("12", {"type": "integer"}) == 12
    assert qwen3_coder_value("1.5", {"type": "integer"}) == "1.5"
    assert qwen3_coder_value("3.0", {"type": "number"}) == 3 and isinstance(qwen3_coder_value("3.0", {"type": "number"}), int)
    assert qwen3_coder_value("2.5", {"type": "float"}) == 2.5
    assert qwen3_coder_value("inf", {"type": "number"}) == "inf"
    assert qwen3_coder_value("TRUE", {"type": "boolean"}) is True
    assert qwen3_coder_value("yes", {"type": "boolean"}) is False
    assert qwen3_coder_value('{"a": 1}', {"type": "object"}) == {"a": 1}
    assert qwen3_coder_value("{'a': 1}", {"type": "object"}) == {"a": 1}  # a Python literal
    assert qwen3_coder_value('"[1, 2]"', {"type": "array"}) == [1, 2]  # a JSON string holding one
    assert qwen3_coder_value("(1, 2)", {"type": "tuple"}) == (1, 2)  # other types: a Python literal
    assert qwen3_coder_value("x y", {"type": "array"}) == "x y"
    assert qwen3_coder_value("7", {"anyOf": [{"type": "null"}, {"type": "integer"}]}) == 7
    assert qwen3_coder_value("7", {"description": "no type"}) == "7"


def test_seed_oss_values_are_typed_as_vllm_does():
    """vLLM's seed_oss rules: qwen3_coder's older ones, "null" first whatever the type, the type's text as written."""
    assert seed_oss_value("5", None) == "5" and seed_oss_value("Null", None) is None  # not declared
    assert seed_oss_value("null", {"type": "string"}) is None and seed_oss_value("None", {"type": "string"}) == "None"
    assert seed_oss_value("12", {"type": "integer"}) == 12 and seed_oss_value("1.5", {"type": "int"}) == "1.5"
    assert seed_oss_value("3.0", {"type": "number"}) == 3 and isinstance(seed_oss_value("3.0", {"type": "number"}), int)
    assert seed_oss_value("inf", {"type": "number"}) == "inf" and seed_oss_value("nan", {"type": "float"}) == "nan"
    assert seed_oss_value("TRUE", {"type": "boolean"}) is True and seed_oss_value("yes", {"type": "bool"}) is False
    assert seed_oss_value('{"a": true}', {"type": "object"}) == {"a": True}
    assert seed_oss_value("{'a': 1}", {"type": "dict"}) == {"a": 1}  # not JSON: a Python literal
    assert seed_oss_value("[1, 2]", {"type": "array"}) == [1, 2] and seed_oss_value("[true]", {"type": "array"}) == \
        "[true]"
    assert seed_oss_value("7", {"type": ["integer", "null"]}) == 7  # "['integer', 'null']": a literal
    assert seed_oss_value("x y", {"type": "tuple"}) == "x y"
    assert seed_oss_value("7", {"anyOf": [{"type": "integer"}]}) == "7"  # no "type": a string


def test_minimax_m2_values_are_typed_as_vllm_does():
    """vLLM's minimax_m2 rules: null words first, then the schema's types in its fixed order, else JSON, else text."""
    assert minimax_m2_value("5", None) == "5"  # not declared: a string
    assert minimax_m2_value("Nil", {"type": "string"}) is None  # null words whatever the type
    assert minimax_m2_value("12", {"type": "integer"}) == 12
    assert minimax_m2_value("1.5", {"type": "integer"}) == 1.5  # int() fails: JSON
    assert minimax_m2_value("3.0", {"type": "number"}) == 3 and isinstance(minimax_m2_value("3.0", {"type": "number"}),
                                                                          int)
    assert minimax_m2_value("inf", {"type": "number"}) == "inf"  # no JSON either: the text
    assert minimax_m2_value("7", {"type": ["string", "integer"]}) == 7  # integer before string
    assert minimax_m2_value("7", {"anyOf": [{"type": "string"}, {"type": "number"}]}) == 7
    assert minimax_m2_value("7", {"oneOf": [{"type": "string"}]}) == "7"
    assert minimax_m2_value("2", {"enum": [1, 2, 3]}) == 2  # the enum's values' type
    assert minimax_m2_value("on", {"type": "boolean"}) is True and minimax_m2_value("0", {"type": "bool"}) is False
    assert minimax_m2_value("maybe", {"type": "boolean"}) == "maybe"
    assert minimax_m2_value('{"a": 1}', {"type": "object"}) == {"a": 1}
    assert minimax_m2_value("{'a': 1}", {"type": "object"}) == "{'a': 1}"  # no Python literals
    assert minimax_m2_value("[1]", {"type": "tuple"}) == [1]  # an unknown type: JSON, else the text
    assert minimax_m2_value("x", {"description": "no type"}) == "x"


def test_minimax_m2_sends_each_parameter_whole():
    parser = make_parser("minimax_m2", tools=TOOLS)
    assert parser.feed('Hi <minimax:tool_call>\n<invoke name="get_weather') == [("content", "Hi")]
    assert parser.feed('">\n<parameter name="days">1') == [("call", 0, "get_weather")]
    assert parser.feed("0</parameter>\n") == [("args", 0, '{"days": 10')]
    assert parser.feed("</invoke>\n</minimax:tool_call> bye") == [("args", 0, "}")]
    assert parser.finish() == [] and parser.called


def test_qwen3_coder_sends_each_parameter_whole():
    parser = make_parser("qwen3_coder", tools=TOOLS)
    assert parser.feed("<tool_call>\n<function=get_weather>\n<parameter=days>\n1") == [("call", 0, "get_weather")]
    assert parser.feed("0\n</parameter>\n") == [("args", 0, '{"days": 10')]
    assert parser.feed("</function>\n</tool_call>") == [("args", 0, "}")]
    assert parser.finish() == []


def test_deepseek_v3_streams_the_arguments_as_written():
    parser = make_parser("deepseek_v3")
    assert parser.feed(f"{B}{C}function{S}f\n```json\n") == [("call", 0, "f")]
    assert parser.feed('{"a": "x ') == [("args", 0, '{"a": "x')]  # blanks may end the arguments: they wait
    assert parser.feed('y"}\n``') == [("args", 0, ' y"}')]
    assert parser.feed(f"`{CE}{E}") == []
    assert parser.finish() == []


def test_deepseek_v31_streams_the_arguments_as_written():
    parser = make_parser("deepseek_v31")
    assert parser.feed(f"{B}{C}f") == []  # the name is known at the separator
    assert parser.feed(S) == [("call", 0, "f")]
    assert parser.feed('{"a": "x ``') == [("args", 0, '{"a": "x ``')]  # blanks may end the arguments: they wait
    assert parser.feed('y"} ') == [("args", 0, 'y"}')]
    assert parser.feed(f"{CE}{E}") == []
    assert parser.finish() == []


def test_kimi_k2_streams_the_arguments_as_written():
    parser = make_parser("kimi_k2")
    assert parser.feed(f"Hi {KB}{KC}functions.f:") == [("content", "Hi")]  # the name is known at the argument tag
    assert parser.feed(f"0{KA}") == [("call", 0, "f", "functions.f:0")]  # the model's id: the call's (vLLM's)
    assert parser.feed('{"a": "x ') == [("args", 0, '{"a": "x')]  # blanks may end the arguments: they wait
    assert parser.feed('y"} <|tool_call_') == [("args", 0, ' y"}')]
    assert parser.feed(f"end|>{KE} bye") == []
    assert parser.finish() == [] and parser.called


def test_glm47_streams_like_glm45():
    parser = make_parser("glm47", tools=TOOLS)
    assert parser.feed("Hi <tool_call>get_weather\n") == [("content", "Hi")]  # the name runs to <arg_key>
    assert parser.feed("<arg_key>city</arg_key>\\") == [("call", 0, "get_weather")]  # maybe an escaped newline
    assert parser.feed("n<arg_value>Pa") == [("args", 0, '{"city": "Pa')]
    assert parser.feed("ris</arg_value></tool_call>") == [("args", 0, 'ris"}')]
    assert parser.finish() == [] and parser.called
    # a tag in prose is content as soon as what follows it cannot be a name (not at the output's end)
    for kind in ("glm45", "glm47"):
        parser = make_parser(kind)
        assert parser.feed("Write <tool_call>") == [("content", "Write")]
        assert fold(parser.feed("NAME then")) == (" <tool_call>NAME then", [])


def test_names_and_refusals(llmc_cli, tmp_path):
    assert {"glm45", "glm47", "qwen3_coder", "deepseek_v3", "deepseek_v31", "minimax_m2", "kimi_k2", "seed_oss"} <= set(
        TOOL_CALL_PARSERS)
    for name in ("deepseek_v32",):
        with pytest.raises(ValueError, match=f"'{name}'; DeepSeek-V3.2's .* not read by llmc; supported: .*deepseek_v31"):
            ServingContext.check_tool_options(True, name)
        with pytest.raises(ValueError, match="not read by llmc"):
            make_parser(name)
        code, err = llmc_cli("run", tmp_path, "--tool-call-parser", name)
        assert code == 2 and "not read by llmc" in err and "deepseek_v3" in err
    assert "glm45" in reasoning_parsers.REASONING_PARSERS


GLM45_REASONING = [
    # (text, reasoning, content): deepseek_r1's rules (vLLM's DeepSeekV3ReasoningWithThinkingParser)
    ("<think>Paris in May.</think>It is mild.", "Paris in May.", "It is mild."),
    ("\n<think>a</think>\n<tool_call>ping\n</tool_call>", "a", "\n<tool_call>ping\n</tool_call>"),
    ("Cut while thinking", "Cut while thinking", ""),
    ("<think></think>Quick answer.", "", "Quick answer."),
]


@pytest.mark.parametrize(("text", "reasoning", "content"), GLM45_REASONING)
def test_glm45_reasoning(text, reasoning, content):
    for kwargs in (None, {}, {"enable_thinking": True}, {"thinking": True, "enable_thinking": False}):
        assert reasoning_parsers.split(reasoning_parsers.make_parser("glm45", kwargs), text) == (reasoning, content)
        for at in range(len(text) + 1):
            parser = reasoning_parsers.make_parser("glm45", kwargs)
            events = parser.feed(text[:at]) + parser.feed(text[at:]) + parser.finish()
            assert ("".join(e[1] for e in events if e[0] == "reasoning"),
                    "".join(e[1] for e in events if e[0] == "content")) == (reasoning, content)
    # thinking switched off (either switch given, neither true): all content, and no reasoning parsed
    for kwargs in ({"enable_thinking": False}, {"thinking": False}, {"enable_thinking": 0, "thinking": None}):
        assert reasoning_parsers.split(reasoning_parsers.make_parser("glm45", kwargs), text) == ("", text)
        assert not reasoning_parsers.thinks("glm45", kwargs)
