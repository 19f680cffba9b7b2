"""The tool call parsers on texts written by hand from the published formats: Hermes 2 Pro's
`<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks and Llama 3.1's JSON calls
`{"name": ..., "parameters": ...}` (several joined by ";"), plus the JSON array of tool_choice
"required" and a named tool_choice. Every text is also streamed split at every character boundary
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


@pytest.mark.parametrize(("text", "content", "calls"), HERMES)
def test_hermes(text, content, calls):
    _check("hermes", text, content, calls)


@pytest.mark.parametrize(("text", "content", "calls"), LLAMA3)
def test_llama3_json(text, content, calls):
    _check("llama3_json", text, content, calls)


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
    assert TOOL_CALL_PARSERS == ("hermes", "llama3_json")
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        make_parser("mistral")
