"""The reasoning parsers on texts written by hand from vLLM's documented behaviour (the reasoning
outputs docs, vllm/reasoning/deepseek_r1_reasoning_parser.py and qwen3_reasoning_parser.py):
`<think>abc</think>xyz` gives reasoning "abc" and content "xyz"; the opening tag may be in the
prompt (only `</think>` in the output); output without `</think>` is all reasoning; qwen3 ends the
reasoning at a `<tool_call>` too, and with enable_thinking false reads it all as content. Every text
is also streamed split at every character boundary, one character at a time, and in three pieces:
the joined pieces must give the same reasoning and content."""

from __future__ import annotations

import pytest

from llmc.runtime.server.reasoning_parsers import (REASONING_PARSERS, WithReasoning, check_name, make_parser,
                                                   split, thinks)
from llmc.runtime.server.tool_parsers import make_parser as make_tool_parser

BOTH = [
    # (text, reasoning, content)
    ("<think>abc</think>xyz", "abc", "xyz"),
    ("abc</think>xyz", "abc", "xyz"),  # the template opened <think> in the prompt
    ("\n<think>\nLet me see: 9.8 > 9.11.\n</think>\n\n9.8 is greater.", "\nLet me see: 9.8 > 9.11.\n", "\n\n9.8 is greater."),
    ("Still thinking, cut by max_tokens", "Still thinking, cut by max_tokens", ""),  # no </think>: all reasoning
    ("<think>abc", "abc", ""),
    ("abc</think>", "abc", ""),
    ("</think>xyz", "", "xyz"),
    ("<think></think>xyz", "", "xyz"),
    # only the first </think> ends the reasoning: after it, every tag is content
    ("a</think>b</think>c<think>d", "a", "b</think>c<think>d"),
    # a <think> after reasoning text is text; look-alikes of the tags stay where they are
    ("a<think>b</think>c", "a<think>b", "c"),
    ("x < y, </thin </think > <think/> </think> <b>done</b> <", "x < y, </thin </think > <think/> ", " <b>done</b> <"),
    # what was held back at the end is what it was in
    ("<thi", "<thi", ""),
    ("ab</thi", "ab</thi", ""),
    ("  \n", "  \n", ""),
    ("", "", ""),
]

DEEPSEEK_R1 = BOTH + [
    # no implicit end: a tool call inside the thinking is thinking
    ("I will call.<tool_call>{}</tool_call>", "I will call.<tool_call>{}</tool_call>", ""),
]

QWEN3 = BOTH + [
    # a <tool_call> before any </think> ends the reasoning, the tag going to the content
    ("I will call.<tool_call>{}</tool_call>", "I will call.", "<tool_call>{}</tool_call>"),
    ("a<tool_call>b</think>c", "a", "<tool_call>b</think>c"),
    ("a</think>b<tool_call>c", "a", "b<tool_call>c"),
    ("<think>a<tool_cal", "a<tool_cal", ""),
]

# vLLM's kimi_k2: deepseek_r1's, and a tool call section (either spelling) before any </think> ends the reasoning,
# the tag going to the content
KIMI_K2 = BOTH + [
    ("I will call.<|tool_calls_section_begin|><|tool_call_begin|>f:0", "I will call.",
     "<|tool_calls_section_begin|><|tool_call_begin|>f:0"),
    ("<think>a<|tool_call_section_begin|>b</think>c", "a", "<|tool_call_section_begin|>b</think>c"),
    ("a</think>b<|tool_calls_section_begin|>c", "a", "b<|tool_calls_section_begin|>c"),
    ("a<tool_call>b", "a<tool_call>b", ""),  # not Kimi's tag
    ("<think>a<|tool_calls_sec", "a<|tool_calls_sec", ""),
]

def _seed(text: str) -> str:
    return text.replace("<think>", "<seed:think>").replace("</think>", "</seed:think>")


# vLLM's seed_oss: deepseek_r1's rules with Seed-OSS's tags; <think> is text to it
SEED_OSS = [tuple(_seed(t) for t in case) for case in BOTH] + [
    ("<think>a</think>b", "<think>a</think>b", ""),
    ("<seed:think>Budget <seed:cot_budget_reflect>used 10</seed:cot_budget_reflect></seed:think>Hi",
     "Budget <seed:cot_budget_reflect>used 10</seed:cot_budget_reflect>", "Hi"),
    ("a</seed:thin", "a</seed:thin", ""),
]

# vLLM's ernie45: deepseek_r1's, the answer unwrapped from <response> ... </response> (ERNIE-4.5-21B-A3B-Thinking's
# "abc\n</think>\n\n<response>\ndef\n</response>\n", or "abc\n</think>\ndef")
ERNIE45 = BOTH + [
    ("abc\n</think>\n\n<response>\ndef\n</response>\n", "abc\n", "\ndef\n"),
    ("abc\n</think>\ndef", "abc\n", "\ndef"),
    ("a</think><response>x</response>y</response>z", "a", "x</response>y"),  # the last </response> ends it
    ("a</think>\n<response>cut", "a", "cut"),  # cut inside: what was written
    ("a</think>\n<respo", "a", "\n<respo"),
    ("a</think>x<response>y</response>", "a", "x<response>y</response>"),  # not after blanks only: as written
    ("a</think><response></response>", "a", ""),
]

# vLLM's granite: "Here is my thought process:" ... "Here is my response:" ... ("Here's" too), at the start
GRANITE = [
    ("Here is my thought process: 2 + 2. Here is my response: 4.", " 2 + 2. ", " 4."),
    ("Here's my thought process:\nhmm\nHere's my response:\nok", "\nhmm\n", "\nok"),
    ("  Here is my thought process:a Here's my response:b Here is my response:c", "a ", "b Here is my response:c"),
    ("Here is my thought process: cut by max_tokens", " cut by max_tokens", ""),
    ("Here is my thought process: a Here is my resp", " a Here is my resp", ""),
    # anything else at the start: all content, exactly
    ("The answer is 4. Here is my response: 4", "", "The answer is 4. Here is my response: 4"),
    ("Here is the answer: 4", "", "Here is the answer: 4"),
    ("  Here is my", "", "  Here is my"),
    ("", "", ""),
]

# vLLM's mistral (Magistral): [THINK] ... [/THINK]; no [THINK]: all content, its first stray [/THINK] dropped
MISTRAL = [
    ("[THINK]Let me see.[/THINK]It is 4.", "Let me see.", "It is 4."),
    ("Intro [THINK]a[/THINK] b", "a", "Intro  b"),
    ("[THINK]cut while thinking", "cut while thinking", ""),
    ("Just an answer.", "", "Just an answer."),
    ("a[/THINK]b[/THINK]c", "", "ab[/THINK]c"),
    ("[THINK]a[/THINK]b[THINK]c[/THINK]", "a", "b[THINK]c[/THINK]"),  # after the reasoning: as written
    ("<think>a</think>b", "", "<think>a</think>b"),
    ("[THINK]a[/THI", "a[/THI", ""),
    ("x[THI", "", "x[THI"),
    ("", "", ""),
]

# vLLM's minimax_m2: reasoning to the first </think> (nothing dropped before it), then content without any </think>
MINIMAX_M2 = [
    ("abc</think>xyz", "abc", "xyz"),
    ("<think>abc</think>xyz", "<think>abc", "xyz"),
    ("Cut while thinking", "Cut while thinking", ""),
    ("a</think>b</think>c<think>d", "a", "bc<think>d"),
    ("a</think>b<</think>/think>c", "a", "b</think>c"),  # one pass, as str.replace: a removal joins no new tag
    ("a</think>x</thin", "a", "x</thin"),
    ("</think>", "", ""),
    ("", "", ""),
]

NO_THINKING = ["<think>abc</think>xyz", "abc</think>xyz", "plain answer", "<tool_call>{}", ""]


def _pieces(text: str):
    """The text whole, at every split into two, one character at a time, and in three pieces."""
    yield [text]
    for at in range(1, len(text)):
        yield [text[:at], text[at:]]
    yield list(text)
    for at in range(1, len(text) - 1, 3):
        yield [text[:at], text[at:at + 2], text[at + 2:]]


def _streamed(parser, pieces: list[str]) -> tuple[str, str]:
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    assert all(event[1] for event in events), "no empty pieces"
    return "".join(e[1] for e in events if e[0] == "reasoning"), "".join(e[1] for e in events if e[0] == "content")


@pytest.mark.parametrize(("name", "text", "reasoning", "content"),
                         [("deepseek_r1", *case) for case in DEEPSEEK_R1] + [("qwen3", *case) for case in QWEN3]
                         + [("kimi_k2", *case) for case in KIMI_K2] + [("seed_oss", *case) for case in SEED_OSS]
                         + [("ernie45", *case) for case in ERNIE45] + [("granite", *case) for case in GRANITE]
                         + [("mistral", *case) for case in MISTRAL])
def test_parser_reads_the_text_the_same_way_whatever_the_split(name, text, reasoning, content):
    assert split(make_parser(name), text) == (reasoning, content)
    for pieces in _pieces(text):
        assert _streamed(make_parser(name), pieces) == (reasoning, content), pieces


@pytest.mark.parametrize("text", NO_THINKING)
def test_qwen3_with_thinking_off_is_all_content(text):
    for kwargs in ({"enable_thinking": False}, {"enable_thinking": False, "other": 1}):
        assert split(make_parser("qwen3", kwargs), text) == ("", text)
    # thinking on (left out, or true): parsed
    assert split(make_parser("qwen3", {"enable_thinking": True}), "abc</think>xyz") == ("abc", "xyz")
    assert split(make_parser("qwen3", {}), "abc") == ("abc", "")


def test_kimi_k2_with_thinking_off_is_all_content():
    """Kimi's switch, chat_template_kwargs {"thinking": false} (vLLM's identity parser then); no other key counts."""
    for kwargs in ({"thinking": False}, {"thinking": 0, "enable_thinking": True}):
        assert not thinks("kimi_k2", kwargs)
        for text in NO_THINKING + ["a<|tool_calls_section_begin|>b"]:
            assert split(make_parser("kimi_k2", kwargs), text) == ("", text)
    for kwargs in (None, {}, {"thinking": True}, {"enable_thinking": False}):
        assert thinks("kimi_k2", kwargs)
        assert split(make_parser("kimi_k2", kwargs), "abc</think>xyz") == ("abc", "xyz")


@pytest.mark.parametrize(("text", "reasoning", "content"), DEEPSEEK_R1)
def test_deepseek_v3_thinks_only_when_switched_on(text, reasoning, content):
    """vLLM's deepseek_v3 (DeepSeek-V3.1's thinking switch): deepseek_r1's rules when chat_template_kwargs
    `thinking` or `enable_thinking` is true (the template then opens <think> in the prompt), else all content."""
    for kwargs in ({"thinking": True}, {"enable_thinking": True}, {"thinking": 1, "enable_thinking": False}):
        assert thinks("deepseek_v3", kwargs)
        for pieces in _pieces(text):
            assert _streamed(make_parser("deepseek_v3", kwargs), pieces) == (reasoning, content), pieces
    for kwargs in (None, {}, {"thinking": False}, {"thinking": 0, "enable_thinking": None}):
        assert not thinks("deepseek_v3", kwargs)
        for pieces in _pieces(text):
            assert _streamed(make_parser("deepseek_v3", kwargs), pieces) == ("", text), pieces


@pytest.mark.parametrize(("text", "reasoning", "content"), MINIMAX_M2)
def test_minimax_m2(text, reasoning, content):
    """minimax_m2 as vLLM's MiniMaxM2ReasoningParser; minimax_m2_append_think: all content, after `<think>`."""
    assert thinks("minimax_m2", None) and thinks("minimax_m2_append_think", {"enable_thinking": False})
    for pieces in _pieces(text):
        assert _streamed(make_parser("minimax_m2"), pieces) == (reasoning, content), pieces
        assert _streamed(make_parser("minimax_m2_append_think"), pieces) == ("", "<think>" + text), pieces


def test_minimax_m2_append_think_streams_the_tag_first():
    parser = make_parser("minimax_m2_append_think")
    assert parser.feed("a") == [("content", "<think>a")]
    assert parser.feed("</think>b") == [("content", "</think>b")]
    assert parser.finish() == []
    tools = WithReasoning(make_parser("minimax_m2_append_think"), make_tool_parser("minimax_m2"))
    events = tools.feed('x</think>Hi <minimax:tool_call><invoke name="f"></invoke></minimax:tool_call>') + tools.finish()
    assert events == [("content", "<think>x</think>Hi"), ("call", 0, "f"), ("args", 0, "{}")]


def test_streamed_reasoning_is_not_held_back_longer_than_a_tag():
    parser = make_parser("deepseek_r1")
    assert parser.feed("<think>") == []
    assert parser.feed("Hmm, 2 <") == [("reasoning", "Hmm, 2 ")]  # "<" may begin </think>: it waits
    assert parser.feed(" 3 ok</th") == [("reasoning", "< 3 ok")]  # the rest of a piece goes at once
    assert parser.feed("ink>Yes") == [("content", "Yes")]
    assert parser.finish() == []


def test_tool_calls_are_read_from_the_content_only():
    text = ('<think>Maybe <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> would help.</think>'
            'Calling.<tool_call>{"name": "g", "arguments": {"y": 2}}</tool_call>')
    for pieces in _pieces(text):
        parser = WithReasoning(make_parser("deepseek_r1"), make_tool_parser("hermes"))
        events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
        assert "".join(e[1] for e in events if e[0] == "reasoning") == \
            'Maybe <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> would help.'
        assert "".join(e[1] for e in events if e[0] == "content") == "Calling."
        assert [e[2] for e in events if e[0] == "call"] == ["g"] and parser.called
        assert "".join(e[2] for e in events if e[0] == "args") == '{"y": 2}'


def test_unknown_names_are_refused_with_the_supported_ones():
    assert REASONING_PARSERS[:7] == ("deepseek_r1", "qwen3", "glm45", "deepseek_v3", "minimax_m2",
                                     "minimax_m2_append_think", "openai_gptoss")
    assert {"kimi_k2", "seed_oss", "ernie45", "granite", "mistral"} <= set(REASONING_PARSERS)
    check_name(None)
    for name in REASONING_PARSERS:
        check_name(name)
    supported = "supported: deepseek_r1, qwen3, glm45, deepseek_v3, minimax_m2, minimax_m2_append_think, openai_gptoss"
    with pytest.raises(ValueError, match=f"'step3'; {supported}"):
        check_name("step3")
    with pytest.raises(ValueError, match=supported):
        make_parser("step3")
