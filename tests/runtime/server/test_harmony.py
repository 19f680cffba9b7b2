"""gpt-oss's harmony output read apart (runtime/server/harmony.py) against the published format (openai/harmony's
docs, the OpenAI cookbook's "harmony response format": the texts below are its examples' shapes, written out by hand):
analysis then final, final only, a tool call with its recipient in the channel or in the role, a preamble, several
messages, an unfinished message at max_tokens, malformed output as content; every split of every text streamed gives
the whole text's reply; the start-up checks."""

from __future__ import annotations

import pytest

from llmc.runtime.server import reasoning_parsers, tool_parsers
from llmc.runtime.server.harmony import HarmonyParser, check_flags, check_model, read_header

THINK = "<|channel|>analysis<|message|>User asks for the weather. Call the tool.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris."
CALL_IN_CHANNEL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                   '{"city": "Paris"}')
CALL_IN_ROLE = '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{"zone": "CET"}'

# (output text as the server sees it, tools read, (reasoning, content, calls))
CASES = [
    (THINK + FINAL, True, ("User asks for the weather. Call the tool.", "It is sunny in Paris.", [])),
    # the output ends at the stop token <|return|>; kept in the text, it ends the message as well
    (THINK + FINAL + "<|return|>", True, ("User asks for the weather. Call the tool.", "It is sunny in Paris.", [])),
    ("<|channel|>final<|message|>Hello!", True, ("", "Hello!", [])),
    ("  <|start|>assistant<|channel|>final<|message|>Hi", False, ("", "Hi", [])),
    (THINK + CALL_IN_CHANNEL, True,
     ("User asks for the weather. Call the tool.", "", [("get_weather", '{"city": "Paris"}')])),
    (THINK + CALL_IN_ROLE + "<|call|>", True,
     ("User asks for the weather. Call the tool.", "", [("get_time", '{"zone": "CET"}')])),
    # a preamble (commentary without a recipient) is content; two calls; two analysis messages joined by a newline
    (THINK + "<|start|>assistant<|channel|>commentary<|message|>Checking both.<|end|>" + CALL_IN_CHANNEL + "<|call|>"
     + "<|start|>assistant<|channel|>analysis<|message|>And the time.<|end|>" + CALL_IN_ROLE, True,
     ("User asks for the weather. Call the tool.\nAnd the time.", "Checking both.",
      [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')])),
    # calls not read (no --tool-call-parser, or tool_choice none): the message as generated is content
    (THINK + CALL_IN_CHANNEL, False,
     ("User asks for the weather. Call the tool.", CALL_IN_CHANNEL, [])),
    # a built-in tool's recipient is not a function call
    ("<|channel|>analysis<|message|>Search.<|end|><|start|>assistant<|channel|>analysis to=browser.search code"
     '<|message|>{"query": "x"}<|call|>', True,
     ("Search.", '<|start|>assistant<|channel|>analysis to=browser.search code<|message|>{"query": "x"}<|call|>', [])),
    # cut by max_tokens: inside the thinking, inside the answer, inside a call, inside a header
    ("<|channel|>analysis<|message|>The user as", True, ("The user as", "", [])),
    (THINK + "<|start|>assistant<|channel|>final<|message|>It is su", True,
     ("User asks for the weather. Call the tool.", "It is su", [])),
    (THINK + CALL_IN_CHANNEL[:-6], True,
     ("User asks for the weather. Call the tool.", "", [("get_weather", '{"city": "P')])),
    (THINK + "<|start|>assistant<|channel|>fin", True, ("User asks for the weather. Call the tool.", "", [])),
    # malformed: output that does not start as a message is content as generated, markers and all; so is what
    # follows a message without <|start|>
    ("It is sunny.<|end|><|start|>assistant", True, ("", "It is sunny.<|end|><|start|>assistant", [])),
    ("", True, ("", "", [])),
    (THINK + "oops <|channel|>final<|message|>x", True,
     ("User asks for the weather. Call the tool.", "oops <|channel|>final<|message|>x", [])),
    # a header that never ends is text after MAX_HEADER characters
    ("<|channel|>" + "word " * 60, True, ("", "<|channel|>" + "word " * 60, [])),
    (THINK + "<|start|>" + "x" * 257 + "<|message|>y", True,
     ("User asks for the weather. Call the tool.", "<|start|>" + "x" * 257 + "<|message|>y", [])),
    (THINK + "<|start|>" + "x" * 256 + "<|message|>y", True, ("User asks for the weather. Call the tool.", "y", [])),
    # a marker-like text that is not a marker stays in the body
    ("<|channel|>final<|message|>a <|endoftext b <|", True, ("", "a <|endoftext b <|", [])),
]


def _read(parser, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    reasoning, rest = reasoning_parsers.reasoning_of(events)
    content, calls = tool_parsers.fold(rest)
    return reasoning or "", content, calls


@pytest.mark.parametrize(("text", "tools", "expected"), CASES)
def test_harmony_output_read_apart(text, tools, expected):
    assert _read(HarmonyParser(tools), [text]) == expected
    assert _read(HarmonyParser(tools), list(text)) == expected  # a character at a time


@pytest.mark.parametrize(("text", "tools", "expected"), CASES)
def test_every_split_streams_the_whole(text, tools, expected):
    for at in range(len(text) + 1):
        for end in (at, min(len(text), at + 7)):
            assert _read(HarmonyParser(tools), [text[:at], text[at:end], text[end:]]) == expected, (at, end)


def test_events_come_in_order_and_calls_are_announced_once():
    parser = HarmonyParser(tools=True)
    text = THINK + CALL_IN_CHANNEL + "<|call|>" + CALL_IN_ROLE
    events = [e for char in text for e in parser.feed(char)] + parser.finish()
    kinds = [e[0] for e in events]
    assert kinds.index("call") > max(i for i, k in enumerate(kinds) if k == "reasoning")
    assert [e for e in events if e[0] == "call"] == [("call", 0, "get_weather"), ("call", 1, "get_time")]
    assert parser.called and parser.num_calls == 2
    # arguments stream as generated: more than one piece
    assert sum(1 for e in events if e[0] == "args" and e[1] == 0) > 3


def test_the_registered_names_build_it():
    assert isinstance(tool_parsers.make_parser("openai"), HarmonyParser) and tool_parsers.make_parser("openai").tools
    reasoning = reasoning_parsers.make_parser("openai_gptoss")
    assert isinstance(reasoning, HarmonyParser) and not reasoning.tools
    assert reasoning_parsers.split(reasoning_parsers.make_parser("openai_gptoss"), THINK + FINAL) == \
        ("User asks for the weather. Call the tool.", "It is sunny in Paris.")


def test_headers():
    assert read_header("assistant<|channel|>commentary to=functions.f <|constrain|>json") == ("commentary", "functions.f")
    assert read_header("assistant to=functions.g<|channel|>commentary json") == ("commentary", "functions.g")
    assert read_header("<|channel|>final") == ("final", None)
    assert read_header("assistant") == (None, None)


def test_start_up_checks():
    check_flags("openai", "openai_gptoss")
    check_flags(None, "openai_gptoss")
    with pytest.raises(ValueError, match="--tool-call-parser openai .*add --reasoning-parser openai_gptoss"):
        check_flags("openai", None)
    with pytest.raises(ValueError, match="use --tool-call-parser openai with it, not hermes"):
        check_flags("hermes", "openai_gptoss")
    check_model("GptOssForCausalLM", "openai", "openai_gptoss")
    check_model("LlamaForCausalLM", "hermes", "deepseek_r1")
    with pytest.raises(ValueError, match="--reasoning-parser openai_gptoss reads gpt-oss's harmony output .*"
                                         "LlamaForCausalLM"):
        check_model("LlamaForCausalLM", None, "openai_gptoss")


def test_responses_output_items():
    """/v1/responses builds its items from the same events: a reasoning item, a message (the preamble), then
    a function_call, in the order written."""
    from llmc.runtime.server.serving_responses import _OutputBuilder

    parser, builder = HarmonyParser(tools=True), _OutputBuilder(False)
    text = THINK + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" + CALL_IN_CHANNEL
    for char in text:
        builder.feed(parser.feed(char))
    builder.feed(parser.finish())
    builder.finish("completed")
    assert [(i["type"], i.get("name")) for i in builder.items] == [("reasoning", None), ("message", None),
                                                                   ("function_call", "get_weather")]
    assert builder.items[0]["content"][0]["text"] == "User asks for the weather. Call the tool."
    assert builder.items[1]["content"][0]["text"] == "Checking."
    assert builder.items[2]["arguments"] == '{"city": "Paris"}'
