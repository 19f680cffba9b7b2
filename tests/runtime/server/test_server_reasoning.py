"""Reasoning outputs over HTTP with the openai client (vLLM's --reasoning-parser), against an
in-process app serving ref-llama-12m with --reasoning-parser deepseek_r1, --enable-auto-tool-choice
--tool-call-parser hermes and --structured-outputs-config '{"enable_in_reasoning": true}': the 12M
model does not think by itself, so its output is forced with guided_choice / guided_regex (which that
last flag lets constrain the whole output) to hold `<think>...</think>`. Replies carry the thinking in
`reasoning` and `reasoning_content`, the answer in `content`; stream deltas carry the same pieces,
which join to the reply; tool calls come from the answer only; n > 1, logprobs and usage (with
completion_tokens_details.reasoning_tokens); qwen3's rules and enable_thinking false; seed_oss's tags with its
tool parser; ernie45's, granite's and mistral's rules; /v1/completions
left unparsed; the 400s for structured output and forced tool calls; the start-up refusals."""

from __future__ import annotations

import httpx
import openai
import pytest

from llmc.runtime.engine import Engine
from llmc.runtime.server.api_server import build_app

MODEL = "ref-llama"
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
THOUGHT = "<think>\nThe user asks about Paris. I should answer.\n</think>\n\nIt is sunny in Paris."


@pytest.fixture(scope="module")
def app(server_artifact, served):
    """(base URL, ServingContext) of the app; tests that switch its settings put them back."""
    app = build_app(lambda: Engine(server_artifact, device="cpu"), MODEL, log_stats=False,
                    enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="deepseek_r1",
                    reasoning_in_structured_output=True)
    with served(app, wait_healthy=True) as base_url:
        yield base_url, app.state.ctx


@pytest.fixture
def client(app) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app[0]}/v1", api_key="none", max_retries=0, timeout=120)


def _body(forced: list[str] | None = None, **extra) -> dict:
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 120, "temperature": 0, **extra}
    if forced is not None:
        body["extra_body"] = {**body.get("extra_body", {}), "guided_choice": forced}
    return body


def _stream(client, **body) -> tuple[list, dict]:
    """The stream's chunks (parsed by the openai SDK), and per choice index its joined reasoning (both
    fields, which must agree), content, calls {index: [name, arguments]}, finish_reason and logprobs;
    asserts that no reasoning comes after content."""
    chunks = list(client.chat.completions.create(stream=True, **body))
    choices: dict[int, dict] = {}
    for chunk in chunks:
        assert isinstance(chunk, openai.types.chat.ChatCompletionChunk)
        for choice in chunk.choices:
            state = choices.setdefault(choice.index, {"reasoning": "", "content": "", "calls": {},
                                                      "finish_reason": None, "logprobs": 0})
            assert state["finish_reason"] is None, "nothing after a choice's finish"
            delta = choice.delta
            reasoning = getattr(delta, "reasoning", None)
            assert reasoning == getattr(delta, "reasoning_content", None)
            if reasoning:
                assert not state["content"] and not state["calls"], "reasoning comes before the answer"
                state["reasoning"] += reasoning
            state["content"] += delta.content or ""
            for call in delta.tool_calls or []:
                entry = state["calls"].setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
            if choice.logprobs is not None:
                state["logprobs"] += len(choice.logprobs.content)
            state["finish_reason"] = choice.finish_reason
    return chunks, choices


def _fields(message) -> tuple[str | None, str | None]:
    assert message.reasoning == message.reasoning_content  # vLLM's name and the older one, both sent
    return message.reasoning, message.content


def _same(streamed: dict, choice) -> None:
    """A stream's joined choice equals the reply's (null fields stream as nothing)."""
    reasoning, content = _fields(choice.message)
    assert streamed["reasoning"] == (reasoning or "") and streamed["content"] == (content or "")
    assert streamed["finish_reason"] == choice.finish_reason
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    assert [tuple(v) for v in streamed["calls"].values()] == calls


def test_reply_and_stream_carry_the_thinking_apart(client):
    body = _body([THOUGHT])
    reply = client.chat.completions.create(**body)
    (choice,) = reply.choices
    assert _fields(choice.message) == ("\nThe user asks about Paris. I should answer.\n", "\n\nIt is sunny in Paris.")
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    details = reply.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < reply.usage.completion_tokens
    chunks, streamed = _stream(client, stream_options={"include_usage": True}, **body)
    _same(streamed[0], choice)
    # in several pieces, not one; the final usage counts the reasoning tokens too
    assert sum(1 for c in chunks for ch in c.choices if getattr(ch.delta, "reasoning", None)) > 2
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == details.reasoning_tokens


@pytest.mark.parametrize(("forced", "reasoning", "content"), [
    (["Paris is in France.</think>It is sunny."], "Paris is in France.", "It is sunny."),  # <think> in the prompt
    (["<think>Paris.</think>"], "Paris.", None),  # the answer empty: null, as vLLM's
    (["It is sunny."], "It is sunny.", None),  # no </think>: all reasoning (current vLLM's deepseek_r1)
])
def test_deepseek_r1_rules(client, forced, reasoning, content):
    body = _body(forced)
    choice = client.chat.completions.create(**body).choices[0]
    assert _fields(choice.message) == (reasoning, content)
    _, streamed = _stream(client, **body)
    _same(streamed[0], choice)


def test_output_cut_inside_the_thinking_is_reasoning(client):
    body = _body(max_tokens=12, extra_body={"guided_regex": "<think>[a-z ]{200}</think>done"})
    choice = client.chat.completions.create(**body).choices[0]
    reasoning, content = _fields(choice.message)
    assert choice.finish_reason == "length" and reasoning and content is None and "<think>" not in reasoning
    _, streamed = _stream(client, **body)
    _same(streamed[0], choice)


def test_n_logprobs_and_usage(client):
    forced = ["<think>Sunny, I think.</think>Sunny.", "<think>Rain is likely here.</think>Rainy.",
              "<think>Hmm</think>"]
    body = _body(forced, n=4, temperature=1.0, seed=5, logprobs=True, top_logprobs=2)  # a seed: the stream samples the same
    reply = client.chat.completions.create(**body)
    assert len(reply.choices) == 4
    pairs = {"<think>Sunny, I think.</think>Sunny.": ("Sunny, I think.", "Sunny."),
             "<think>Rain is likely here.</think>Rainy.": ("Rain is likely here.", "Rainy."),
             "<think>Hmm</think>": ("Hmm", None)}
    for choice in reply.choices:
        assert _fields(choice.message) in pairs.values()
        assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
    assert sum(len(c.logprobs.content) for c in reply.choices) == reply.usage.completion_tokens
    assert 0 < reply.usage.completion_tokens_details.reasoning_tokens < reply.usage.completion_tokens
    chunks, streamed = _stream(client, stream_options={"include_usage": True}, **body)
    assert sorted(streamed) == [0, 1, 2, 3]
    for choice in reply.choices:
        _same(streamed[choice.index], choice)
    usage = chunks[-1].usage
    assert sum(s["logprobs"] for s in streamed.values()) == usage.completion_tokens == reply.usage.completion_tokens
    assert usage.completion_tokens_details.reasoning_tokens == reply.usage.completion_tokens_details.reasoning_tokens


def test_tool_calls_come_from_the_answer_only(client):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    body = _body(["<think>Use " + call + "</think>Let me check.\n" + call], tools=TOOLS, max_tokens=220)
    choice = client.chat.completions.create(**body).choices[0]  # tool_choice left out: "auto"
    assert _fields(choice.message) == ("Use " + call, "Let me check.")
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == \
        [("get_weather", '{"city": "Paris"}')]
    assert choice.finish_reason == "tool_calls"
    _, streamed = _stream(client, **body)
    _same(streamed[0], choice)
    # a call only in the thinking is no call
    body = _body(["<think>Maybe " + call + "</think>It is sunny."], tools=TOOLS)
    choice = client.chat.completions.create(**body).choices[0]
    assert _fields(choice.message) == ("Maybe " + call, "It is sunny.")
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    _, streamed = _stream(client, **body)
    _same(streamed[0], choice)


def test_qwen3_rules_and_enable_thinking_false(client, switch):
    switch(reasoning_parser="qwen3")
    for forced, expected in [(THOUGHT, ("\nThe user asks about Paris. I should answer.\n", "\n\nIt is sunny in Paris.")),
                             ("Thinking</think>Sunny.", ("Thinking", "Sunny.")),
                             ("Only thinking", ("Only thinking", None))]:
        body = _body([forced])
        choice = client.chat.completions.create(**body).choices[0]
        assert _fields(choice.message) == expected
        _, streamed = _stream(client, **body)
        _same(streamed[0], choice)
    # a <tool_call> ends the thinking (Qwen3.5 may call from inside it)
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    body = _body(["I should call." + call], tools=TOOLS)
    choice = client.chat.completions.create(**body).choices[0]
    assert _fields(choice.message) == ("I should call.", None) and choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.arguments == '{"city": "Rome"}'
    _, streamed = _stream(client, **body)
    _same(streamed[0], choice)
    # enable_thinking false: all content, tags and all; structured output and forced calls are allowed
    switch(reasoning_in_structured_output=False)
    off = {"chat_template_kwargs": {"enable_thinking": False}, "guided_choice": [THOUGHT]}
    body = _body(extra_body=off)
    reply = client.chat.completions.create(**body)
    assert _fields(reply.choices[0].message) == (None, THOUGHT)
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0
    _, streamed = _stream(client, **body)
    _same(streamed[0], reply.choices[0])
    forced_call = client.chat.completions.create(**_body(tools=TOOLS, tool_choice="required", max_tokens=40,
                                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}}))
    assert forced_call.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_seed_oss_reasoning_then_calls(client, switch):
    """Seed-OSS: --reasoning-parser seed_oss reads <seed:think> ... </seed:think> apart, --tool-call-parser seed_oss
    the calls of the answer (<seed:tool_call><function=...>), typed by the request's tool schema."""
    switch(reasoning_parser="seed_oss", tool_call_parser="seed_oss")
    call = "<seed:tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n" \
           "</seed:tool_call>"
    body = _body(["<seed:think>Use " + call + "</seed:think>Let me check.\n" + call], tools=TOOLS, max_tokens=220)
    choice = client.chat.completions.create(**body).choices[0]
    assert _fields(choice.message) == ("Use " + call, "Let me check.") and choice.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == \
        [("get_weather", '{"city": "Paris"}')]
    _, streamed = _stream(client, **body)
    _same(streamed[0], choice)
    body = _body(["Still thinking <think>"])  # no </seed:think>: all reasoning; <think> is text to Seed
    choice = client.chat.completions.create(**body).choices[0]
    assert _fields(choice.message) == ("Still thinking <think>", None)


@pytest.mark.parametrize(("parser", "forced", "reasoning", "content"), [
    ("ernie45", "Paris.\n</think>\n\n<response>\nSunny.\n</response>\n", "Paris.\n", "\nSunny.\n"),
    ("granite", "Here is my thought process: Paris. Here is my response: Sunny.", " Paris. ", " Sunny."),
    ("granite", "Sunny.", None, "Sunny."),
    ("mistral", "[THINK]Paris.[/THINK]Sunny.", "Paris.", "Sunny."),
    ("mistral", "Sunny.", None, "Sunny."),
])
def test_ernie45_granite_and_mistral_rules(client, switch, parser, forced, reasoning, content):
    switch(reasoning_parser=parser)
    body = _body([forced])
    choice = client.chat.completions.create(**body).choices[0]
    assert _fields(choice.message) == (reasoning, content)
    _, streamed = _stream(client, **body)
    _same(streamed[0], choice)


def test_mistral_keeps_special_tokens_in_the_text(client, switch):
    """Magistral's [THINK] and [/THINK] are special tokens: --reasoning-parser mistral keeps special tokens in the text
    (the 12M model's <|im_start|>, a special token, stands for them here); deepseek_r1 does not."""
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "temperature": 0, "logit_bias": {"2": 100}}
    assert _fields(client.chat.completions.create(**body).choices[0].message) == (None, None)
    switch(reasoning_parser="mistral")
    assert _fields(client.chat.completions.create(**body).choices[0].message) == (None, "<|im_start|>" * 2)


def test_without_the_structured_outputs_flag_constraints_are_refused(client, switch):
    switch(reasoning_in_structured_output=False)
    for extra, param in [({"guided_choice": ["a"]}, "guided_choice"), ({"guided_regex": "a+"}, "guided_regex"),
                         ({"response_format": {"type": "json_object"}}, "response_format")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**_body(extra_body=extra))
        message = info.value.body["message"]
        assert info.value.status_code == 400 and info.value.body["param"] == param
        assert "--reasoning-parser deepseek_r1" in message and '{"enable_in_reasoning": true}' in message
    # a plain request is served
    reply = client.chat.completions.create(**_body(max_tokens=4))
    assert reply.choices[0].message.reasoning is not None


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_are_refused(client, tool_choice):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**_body(tools=TOOLS, tool_choice=tool_choice))
    assert info.value.body["param"] == "tool_choice" and '"auto"' in info.value.body["message"]
    assert "--reasoning-parser deepseek_r1" in info.value.body["message"]


def test_completions_are_not_parsed(client):
    completion = client.completions.create(model=MODEL, prompt="Hello", max_tokens=40, temperature=0,
                                           extra_body={"guided_choice": ["<think>a</think>b"]})
    assert completion.choices[0].text == "<think>a</think>b"
    assert not hasattr(completion.choices[0], "reasoning") and completion.usage.completion_tokens_details is None


def test_a_server_without_the_parser_keeps_the_plain_shape(app, switch):
    def post(body: dict) -> dict:  # the openai client's extra_body, as it sends it
        body = {**{k: v for k, v in body.items() if k != "extra_body"}, **body.get("extra_body", {})}
        return httpx.post(f"{app[0]}/v1/chat/completions", json=body, timeout=60).json()

    switch(reasoning_parser=None)
    reply = post(_body(["<think>a</think>b"]))
    message = reply["choices"][0]["message"]
    assert message["content"] == "<think>a</think>b" and "reasoning" not in message and "reasoning_content" not in message
    assert "completion_tokens_details" not in reply["usage"]
    # with the parser, both fields are always there (null when there is no reasoning)
    switch(reasoning_parser="qwen3")
    body = _body(extra_body={"chat_template_kwargs": {"enable_thinking": False}, "guided_choice": ["plain"]})
    message = post(body)["choices"][0]["message"]
    assert message["reasoning"] is None and message["reasoning_content"] is None and message["content"] == "plain"


def test_server_flags_are_checked_at_start_up(llmc_cli, tmp_path):
    code, err = llmc_cli("run", tmp_path, "--reasoning-parser", "step3")
    assert code == 2 and "'deepseek_r1'" in err and "'qwen3'" in err
    code, err = llmc_cli("run", tmp_path, "--prompt", "hi", "--reasoning-parser", "qwen3")
    assert code == 2 and "--reasoning-parser applies to the server" in err
    code, err = llmc_cli("run", tmp_path, "--input", tmp_path / "in.jsonl", "--output", tmp_path / "out.jsonl",
                         "--reasoning-parser", "deepseek_r1")
    assert code == 2 and "--reasoning-parser applies to the server" in err
    code, err = llmc_cli("run", tmp_path, "--structured-outputs-config", '{"backend": "guidance"}')
    assert code == 2 and "llmc's structured output is xgrammar" in err
    code, err = llmc_cli("run", tmp_path, "--structured-outputs-config", '{"reasoning_parser": "x"}')
    assert code == 2 and "enable_in_reasoning" in err and "reasoning_parser" in err
    code, err = llmc_cli("run", tmp_path, "--structured-outputs-config", '{"enable_in_reasoning": "yes"}')
    assert code == 2 and "true or false" in err
    code, err = llmc_cli("run", tmp_path, "--chat", "--structured-outputs-config", '{"enable_in_reasoning": true}')
    assert code == 2 and "--structured-outputs-config applies to the server" in err
    with pytest.raises(ValueError, match="supported: deepseek_r1, qwen3"):
        build_app(lambda: None, MODEL, reasoning_parser="step3")


@pytest.mark.slow  # a server of its own: 4 s on 2 cores
def test_llmc_run_serves_with_the_flags(start_server):
    server = start_server("--served-model-name", MODEL, "--disable-log-stats", "--reasoning-parser", "qwen3",
                          "--structured-outputs-config", '{"enable_in_reasoning": true}')
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    choice = client.chat.completions.create(**_body(["Hmm.</think>Sunny."])).choices[0]
    assert _fields(choice.message) == ("Hmm.", "Sunny.")
    assert server.terminate() == 0
