"""The tool call parsers on texts written by hand from the published formats: Hermes 2 Pro's
`<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks and Llama 3.1's JSON calls
`{"name": ..., "parameters": ...}` (several joined by ";"), plus the JSON array of tool_choice
"required" and a named tool_choice; Mistral's `[TOOL_CALLS]` calls (a JSON array before tokenizer v11,
`name[ARGS]{...}` after) and the Python list of calls of Llama 3.2 / 4 ("pythonic"). Every text is also streamed split at every character boundary
and one character at a time: the joined pieces must give the same content and calls."""

from __future__ import annotations

import json

import pytest

from llmc.runtime.server.tool_parsers import TOOL_CALL_PARSERS, fold, make_parser, parse

WEATHER = '{"city": "Paris", "days": [1, {"a": "}]"}], "note": "say \\"hi\\" <b>"}'

HERMES = [
    # (text, content, [(name, arguments)])
    (f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>', "", [("get_weather", WEATHER)]),
    ('Let me look.\n<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>', "Let me look.", [("f", '{"x": 1}')]),
    ('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>',
     "", [("f", '{"x": 1}'), ("g", "{}")]),
    ('A<tool_call>{"name": "f", "arguments": {}}</tool_call> and B', "A and B", [("f", "{}")]),
    # "arguments" before "name", a number as arguments, no arguments at all (an empty object)
    ('<tool_call>{"arguments": {"k": true}, "name": "f"}</tool_call>', "", [("f", '{"k": true}')]),
    ('<tool_call>{"name": "f", "arguments": 12}</tool_call>', "", [("f", "12")]),
    ('<tool_call>{"name": "f"}</tool_call>', "", [("f", "{}")]),
    # "parameters", Llama 3's key, written in a block: the arguments all the same, not a call without any
    ('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>', "", [("f", '{"x": 1}')]),
    # a block left open at the end: the call counts up to the end (vLLM's "<tool_call>(.*)")
    ('<tool_call>{"name": "f", "arguments": {"x": "ab', "", [("f", '{"x": "ab')]),
    # cut before its arguments (max_tokens): none were generated, and none are invented ("{}" would pass
    # for a whole call; vLLM's stream sends no arguments for it either)
    ('<tool_call>{"name": "f", "argu', "", [("f", "")]),
    ('<tool_call>{"name": "f"</tool_call>', "", [("f", "")]),
    # broken JSON: a block whose name cannot be read is content, tags and all
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ('x <tool_call>{"name": 3, "arguments": {}}</tool_call>', 'x <tool_call>{"name": 3, "arguments": {}}</tool_call>', []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>{"name" "f"}</tool_call>ok', '<tool_call>{"name" "f"}</tool_call>ok', []),
    # broken after the name: the call stands with what was read
    ('<tool_call>{"name": "f", "arguments": {"x": 1}} trailing</tool_call>', "", [("f", '{"x": 1}')]),
    # no call: the text comes back exactly, blanks, lone tags and all
    ("  Just text, < and <tool and </tool_call>.\n", "  Just text, < and <tool and </tool_call>.\n", []),
    ("", "", []),
]

LLAMA3 = [
    ('{"name": "get_weather", "parameters": ' + WEATHER + "}", "", [("get_weather", WEATHER)]),
    ('{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": {"b": "x;y"}}', "",
     [("f", '{"a": 1}'), ("g", '{"b": "x;y"}')]),
    ('<|python_tag|>{"name": "f", "parameters": {}}', "", [("f", "{}")]),
    ('  {"name": "f", "parameters": {"q": null}}\n', "", [("f", '{"q": null}')]),
    ('{"name": "f", "parameters": {}} That is all.', "That is all.", [("f", "{}")]),
    ('{"name": "f"}', "", [("f", "{}")]),  # no arguments: the function called without any
    ('{"name": "f", "para', "", [("f", "")]),  # cut before them: none invented
    # not a call: plain text, JSON without a name, text before the JSON, broken JSON
    ("The weather is fine.", "The weather is fine.", []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),
    ('Sure: {"name": "f", "parameters": {}}', 'Sure: {"name": "f", "parameters": {}}', []),
    ('{"name": f}', '{"name": f}', []),
    ('{"name": "f", "parameters": {}}; {"oops": 1}', '; {"oops": 1}', [("f", "{}")]),
    ("<|python_tag|>hello", "<|python_tag|>hello", []),
    ("  ", "  ", []),
]

V11 = '{"city": "Paris", "note": "[ARGS] and [TOOL_CALLS] in a string", "days": [1, {"a": "}"}]}'
MISTRAL = [
    # before tokenizer v11: a JSON array of {"name", "arguments"}
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": ' + WEATHER + "}]", "", [("get_weather", WEATHER)]),
    ('[TOOL_CALLS] [{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]', "",
     [("f", '{"x": 1}'), ("g", "{}")]),
    ('Let me look.\n[TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}]', "Let me look.", [("f", '{"x": 1}')]),
    ('[TOOL_CALLS][{"name": "f"}]', "", [("f", "{}")]),
    ('[TOOL_CALLS][{"name": "f", "arguments": {"x": "a', "", [("f", '{"x": "a')]),  # cut
    ('[TOOL_CALLS][{"name": "f", "argu', "", [("f", "")]),  # cut before the arguments: none invented
    # v11+: name[ARGS]{...}, the tag again for each call
    ("[TOOL_CALLS]get_weather[ARGS]" + V11, "", [("get_weather", V11)]),
    ('Sure.[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g_2[ARGS]{}', "Sure.", [("f", '{"x": 1}'), ("g_2", "{}")]),
    ('[TOOL_CALLS]f[ARGS]{"x": 1} Done.', " Done.", [("f", '{"x": 1}')]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', "", [("get_weather", '{"city": "Pa')]),  # cut
    ("[TOOL_CALLS]f[ARGS]", "", [("f", "")]),
    # not a call: the tag is content, and the text after it is read on (a later tag still counts)
    ("[TOOL_CALLS]get_wea", "[TOOL_CALLS]get_wea", []),  # cut before [ARGS]: the name is not known
    ("[TOOL_CALLS]not a call", "[TOOL_CALLS]not a call", []),
    ("[TOOL_CALLS][1, 2]", "[TOOL_CALLS][1, 2]", []),
    ('[TOOL_CALLS][{"city": "Paris"}]', '[TOOL_CALLS][{"city": "Paris"}]', []),
    ("[TOOL_CALLS][TOOL_CALLS]f[ARGS]{}", "[TOOL_CALLS]", [("f", "{}")]),
    # broken after a call was read: the calls stand, the rest up to the next tag is dropped
    ('[TOOL_CALLS][{"name": "f", "arguments": {}}, {"oops": 1}] x [TOOL_CALLS]g[ARGS]{}', "", [("f", "{}"), ("g", "{}")]),
    ("[TOOL_CALLS]f[ARGS]oops", "", [("f", "")]),
    ("  Just text, [TOOL and [ARGS] and [].\n", "  Just text, [TOOL and [ARGS] and [].\n", []),
]

PYTHONIC = [
    ('[get_weather(city="San Francisco", metric="celsius"), get_time()]', "",
     [("get_weather", '{"city": "San Francisco", "metric": "celsius"}'), ("get_time", "{}")]),
    ('<|python_start|>[f(a=[1, {"k": (2, 3)}], b=None, c=True, d=-1.5)]<|python_end|>', "",
     [("f", '{"a": [1, {"k": [2, 3]}], "b": null, "c": true, "d": -1.5}')]),
    # brackets, parentheses and quotes inside strings, triple-quoted ones included
    ("""[f(s="a]b)'", t='x"', u=\"\"\"tri"ple]\"\"\", v=''), g(x='it\\'s')]""", "",
     [("f", '{"s": "a]b)\'", "t": "x\\"", "u": "tri\\"ple]", "v": ""}'), ("g", '{"x": "it\'s"}')]),
    ('[f(city="Zürich")]\n', "", [("f", '{"city": "Zürich"}')]),
    ("[f(a=1)]<|python_end|> That is all.", "That is all.", [("f", '{"a": 1}')]),
    # cut: the whole calls stand, a call cut after its name stands with no arguments (none invented)
    ('[f(a=1), g(b="x', "", [("f", '{"a": 1}'), ("g", "")]),
    ("[f(a=1), ", "", [("f", '{"a": 1}')]),
    ("[get_wea", "[get_wea", []),
    # not calls: all content, exactly
    ("[f(a=x)]", "[f(a=x)]", []),  # not a literal
    ("[f(1)]", "[f(1)]", []),  # positional
    ("[f(a=1), 2]", "[f(a=1), 2]", []),
    ("[m.f(a=1)]", "[m.f(a=1)]", []),
    ("[f(a={1, 2})] and more", "[f(a={1, 2})] and more", []),  # a set: no JSON for it
    ("[1, 2, 3]", "[1, 2, 3]", []),
    ("[]", "[]", []),
    ("Sure: [f()]", "Sure: [f()]", []),
    ("<|python_start|>hello", "<|python_start|>hello", []),
    ("  ", "  ", []),
]

# Llama 4's pythonic calls (its chat template's form: the list, or the list in <|python_start|> ... <|python_end|>),
# read as vLLM's llama4_pythonic reads them; plus every pythonic case
LLAMA4 = PYTHONIC + [
    ('<|python_start|>[get_weather(city="Paris", days=2)]<|python_end|>', "",
     [("get_weather", '{"city": "Paris", "days": 2}')]),
    ("<|python_start|>[f(), g(x=[1, 2])]", "", [("f", "{}"), ("g", '{"x": [1, 2]}')]),  # the end tag not written
    ('<|python_start|>[f(a="x"), g(b=1', "", [("f", '{"a": "x"}'), ("g", "")]),  # cut: g's arguments not whole
    ("<|python_start|>[f(a=x)]<|python_end|>", "<|python_start|>[f(a=x)]<|python_end|>", []),  # not a literal
]

# ERNIE 4.5's template: hermes's blocks ("arguments" only); vLLM's ernie45 keeps no content after the first call
ERNIE45 = [
    (f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n', "", [("get_weather", WEATHER)]),
    ('Let me look.\n\n<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\nand then\n<tool_call>{"name": "g"}'
     "</tool_call> done", "Let me look.", [("f", '{"x": 1}'), ("g", "{}")]),
    ('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>', "", [("f", "{}")]),  # "parameters" not read
    ('<tool_call>{"name": "f", "arguments": {"x": "ab', "", [("f", '{"x": "ab')]),  # cut
    ("<tool_call>not json</tool_call> ok", "<tool_call>not json</tool_call> ok", []),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>oops</tool_call>', "", [("f", "{}")]),
    ("No call here.\n", "No call here.\n", []),
]

# Granite 3.0's <|tool_call|> token / 3.1+'s <tool_call> string, then a JSON array of {"name", "arguments"}
GRANITE = [
    ('<|tool_call|>[{"name": "get_weather", "arguments": ' + WEATHER + "}]", "", [("get_weather", WEATHER)]),
    (' <tool_call>[{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]', "",
     [("f", '{"x": 1}'), ("g", "{}")]),
    ('<|tool_call|> <tool_call> [{"name": "f", "arguments": {}}]', "", [("f", "{}")]),
    ('[{"name": "f", "arguments": {"a": [1]}}]', "", [("f", '{"a": [1]}')]),  # the tag left out
    ('<tool_call>[{"name": "f", "arguments": {"s": "x', "", [("f", '{"s": "x')]),  # cut
    ('<tool_call>[{"name": "f", "arguments": {}}] trailing', "", [("f", "{}")]),  # after the array: dropped
    # not calls: all content, exactly
    ('<tool_call>{"name": "f", "arguments": {}}', '<tool_call>{"name": "f", "arguments": {}}', []),
    ('Sure: <tool_call>[{"name": "f"}]', 'Sure: <tool_call>[{"name": "f"}]', []),
    ("<tool_call>[1, 2]", "<tool_call>[1, 2]", []),
    ("<|tool_call|>hello", "<|tool_call|>hello", []),
    ("<tool", "<tool", []),
    ("The weather is fine.", "The weather is fine.", []),
]

# OLMo 3's template: <function_calls>, one Python call a line (JSON's true / false / null allowed), </function_calls>
OLMO3 = [
    ('<function_calls>\nget_weather(city="Paris", days=[1, 2])\nget_time()\n</function_calls>', "",
     [("get_weather", '{"city": "Paris", "days": [1, 2]}'), ("get_time", "{}")]),
    ('  <function_calls>f(a=true, b=null, c={"k": false}, d=True)</function_calls>', "",
     [("f", '{"a": true, "b": null, "c": {"k": false}, "d": true}')]),
    ("<function_calls>\nf(s='x\\ny')\n</function_calls>\nDone.", "", [("f", '{"s": "x\\ny"}')]),  # after: dropped
    # cut: the whole lines stand, a call cut after its name with no arguments (none invented)
    ('<function_calls>\nf(a=1)\ng(b="x', "", [("f", '{"a": 1}'), ("g", "")]),
    ("<function_calls>\nf(a=1)\n", "", [("f", '{"a": 1}')]),
    # not calls: all content, exactly
    ("<function_calls>\nf(a=x)\n</function_calls>", "<function_calls>\nf(a=x)\n</function_calls>", []),
    ("<function_calls>\nI will call f.\nf()\n</function_calls>", "<function_calls>\nI will call f.\nf()\n"
     "</function_calls>", []),
    ("<function_calls></function_calls>", "<function_calls></function_calls>", []),
    ("<function_calls>\nget_wea", "<function_calls>\nget_wea", []),
    ("get_weather(city='Paris')", "get_weather(city='Paris')", []),  # without the tag (vLLM's stream: content)
    ("Sure. <function_calls>f()</function_calls>", "Sure. <function_calls>f()</function_calls>", []),
    ("<function", "<function", []),
    ("", "", []),
]

REQUIRED = [
    ('[{"name":"f","parameters":{"a":1}}]', "", [("f", '{"a":1}')]),
    ('[{"name":"f","parameters":{"a":[1,2]}},{"name":"g","parameters":{}}]', "", [("f", '{"a":[1,2]}'), ("g", "{}")]),
    ('[{"name":"f","parameters":{"s":"x', "", [("f", '{"s":"x')]),  # cut by max_tokens
    ('[{"name":"f","parameters":{}},{"name":"g","par', "", [("f", "{}"), ("g", "")]),  # cut before g's arguments
    ("[", "", []),
]


def _streamed(kind: str, pieces: list[str], name: str | None = None):
    parser = make_parser(kind, name)
    events = [event for piece in pieces for event in parser.feed(piece)] + parser.finish()
    return fold(events), parser.called


def _check(kind: str, text: str, content: str, calls: list, name: str | None = None) -> None:
    assert parse(make_parser(kind, name), text) == (content, calls)
    for cut in range(len(text) + 1):
        assert _streamed(kind, [text[:cut], text[cut:]], name)[0] == (content, calls), cut
    assert _streamed(kind, list(text), name) == ((content, calls), bool(calls))


@pytest.mark.parametrize(("kind", "text", "content", "calls"),
                         [(kind, *case) for kind, cases in [("hermes", HERMES), ("llama3_json", LLAMA3),
                                                            ("mistral", MISTRAL), ("pythonic", PYTHONIC),
                                                            ("llama4_json", LLAMA3), ("llama4_pythonic", LLAMA4),
                                                            ("ernie45", ERNIE45), ("granite", GRANITE),
                                                            ("olmo3", OLMO3)]
                          for case in cases])
def test_parser(kind, text, content, calls):
    _check(kind, text, content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), REQUIRED)
def test_required_array(text, content, calls):
    _check("required", text, content, calls)


def test_named_choice_is_the_whole_output():
    _check("named", '{"city":"Paris"}', "", [("get_weather", '{"city":"Paris"}')], name="get_weather")
    _check("named", "", "", [("get_weather", "")], name="get_weather")


def test_arguments_of_well_formed_calls_are_the_json_written():
    """The arguments text is the JSON value as written: json.loads gives what the model meant."""
    (_, calls), = [parse(make_parser("hermes"), HERMES[0][0])]
    assert json.loads(calls[0][1]) == {"city": "Paris", "days": [1, {"a": "}]"}], "note": 'say "hi" <b>'}
    (_, calls), = [parse(make_parser("mistral"), MISTRAL[6][0])]
    assert json.loads(calls[0][1]) == {"city": "Paris", "note": "[ARGS] and [TOOL_CALLS] in a string",
                                       "days": [1, {"a": "}"}]}
    (_, calls), = [parse(make_parser("pythonic"), PYTHONIC[2][0])]
    assert [json.loads(args) for _, args in calls] == [{"s": "a]b)'", "t": 'x"', "u": 'tri"ple]', "v": ""},
                                                       {"x": "it's"}]


def test_mistral_holds_back_only_what_may_be_a_tag():
    """Content streams up to a possible `[TOOL_CALLS]`; the v11 arguments stream piece by piece."""
    parser = make_parser("mistral")
    assert parser.feed("Hi [TOOL") == [("content", "Hi")]
    assert parser.feed("_CALLS]f[AR") == []
    assert parser.feed('GS]{"x": ') == [("call", 0, "f"), ("args", 0, '{"x":')]
    assert parser.feed("1}") == [("args", 0, " 1}")]
    assert parser.finish() == []


def test_pythonic_sends_the_calls_when_the_list_closes():
    """Nothing is sent before the closing `]` (a later element may make it all content); then every call whole."""
    parser = make_parser("pythonic")
    assert parser.feed('[f(a=1), g(b="]")') == []
    assert parser.feed("] ok") == [("call", 0, "f"), ("args", 0, '{"a": 1}'), ("call", 1, "g"),
                                   ("args", 1, '{"b": "]"}'), ("content", "ok")]


def test_events_come_in_vllm_s_order():
    """A call's name is one event, before any of its arguments; content is not held past a call."""
    parser = make_parser("hermes")
    events = parser.feed('Hi <tool_call>{"name": "f", "argu') + parser.feed('ments": {"x": 1') + parser.feed("2}}")
    events += parser.feed("</tool_call>") + parser.finish()
    assert events[0] == ("content", "Hi")
    assert events[1] == ("call", 0, "f")
    assert [e for e in events[2:] if e[0] != "args"] == []
    assert "".join(e[2] for e in events[2:]) == '{"x": 12}' and len(events[2:]) >= 2


def test_unknown_parser_lists_the_supported_ones():
    assert TOOL_CALL_PARSERS[:11] == ("hermes", "llama3_json", "mistral", "pythonic", "glm45", "glm47", "qwen3_coder",
                                      "deepseek_v3", "deepseek_v31", "minimax_m2", "openai")
    assert {"llama4_json", "llama4_pythonic", "ernie45", "granite", "olmo3"} <= set(TOOL_CALL_PARSERS)
    with pytest.raises(ValueError, match="glm45, glm47, qwen3_coder, deepseek_v3, deepseek_v31, minimax_m2, openai, "
                                         "llama4_json"):
        make_parser("step3")
