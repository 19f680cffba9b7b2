"""gpt-oss's harmony output over HTTP with the openai client (vLLM's --reasoning-parser openai_gptoss and
--tool-call-parser openai), against an in-process app serving a tiny random gpt-oss (tests/conftest.py's) whose
tokenizer has harmony's seven markers as special tokens, as gpt-oss's has. The random model writes no harmony by
itself: its output is forced with guided_choice (--structured-outputs-config enable_in_reasoning lets it constrain
the whole output), and a logit_bias on the markers' ids makes it write each marker as its special token, not as
text. Replies carry the analysis channel in reasoning / reasoning_content, the final channel in content and
messages to functions.NAME in tool_calls; streams join to the replies; the markers never reach a reply without the
parsers (special tokens skipped); an assistant's reasoning and calls sent back reach the chat template as its
`thinking` and `tool_calls`; the start-up refusals."""

from __future__ import annotations

import openai
import pytest

from llmc.runtime.engine import Engine
from llmc.runtime.server.api_server import build_app
from tests.conftest import make_hf_checkpoint
from tests.runtime.hf_oracle import build_float32

MODEL = "gpt-oss-tiny"
MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
THOUGHT = "The user asks about Paris. Call the tool."
ANSWER = "<|channel|>analysis<|message|>" + THOUGHT + "<|end|><|start|>assistant<|channel|>final<|message|>Sunny."
CALL = ("<|channel|>analysis<|message|>" + THOUGHT + "<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}')
# A template that renders an assistant's analysis and calls as gpt-oss's published template reads them: the
# analysis from `thinking`, one call per message from tool_calls[0].function, its arguments an object written with
# tojson (a test's own, much shortened).
HARMONY_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}"
    "{% if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}"
    "<|start|>assistant to=functions.{{ m.tool_calls[0].function.name }}<|channel|>commentary json<|message|>"
    "{{ m.tool_calls[0].function.arguments | tojson }}<|call|>"
    "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """A tiny gpt-oss whose vocabulary ends with harmony's markers, special tokens of its tokenizer."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("harmony")
    checkpoint = make_hf_checkpoint(root / "ck", "gpt_oss", vocab_size=4096 + 8)
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    tokenizer.save_pretrained(str(checkpoint))
    return build_float32(checkpoint, root / "art")


@pytest.fixture(scope="module")
def app(artifact, served):
    app = build_app(lambda: Engine(artifact, device="cpu"), MODEL, log_stats=False, trust_request_chat_template=True,
                    enable_auto_tool_choice=True, tool_call_parser="openai", reasoning_parser="openai_gptoss",
                    reasoning_in_structured_output=True)
    with served(app, wait_healthy=True) as base_url:
        yield base_url, app.state.ctx


@pytest.fixture
def client(app) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app[0]}/v1", api_key="none", max_retries=0, timeout=120)


def _marker_ids(app) -> list[int]:
    ids = app[1].tokenizer.convert_tokens_to_ids(MARKERS)
    assert ids == list(range(4096, 4103))
    return ids


def _body(app, forced: str, **extra) -> dict:
    """A greedy chat request forced to write `forced`, each marker as its special token."""
    bias = {str(i): 50 for i in _marker_ids(app)}
    return {"model": MODEL, "messages": CHAT, "max_tokens": 120, "temperature": 0,
            "extra_body": {"guided_choice": [forced], "logit_bias": bias, **extra.pop("extra_body", {})}, **extra}


def _stream(client, body: dict) -> dict:
    """The stream's joined reasoning (both fields agreeing), content, calls {index: [name, arguments]} and
    finish_reason; asserts no reasoning comes after the answer."""
    state = {"reasoning": "", "content": "", "calls": {}, "finish_reason": None}
    for chunk in client.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            reasoning = getattr(choice.delta, "reasoning", None)
            assert reasoning == getattr(choice.delta, "reasoning_content", None)
            if reasoning:
                assert not state["content"] and not state["calls"]
                state["reasoning"] += reasoning
            state["content"] += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = state["calls"].setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
            state["finish_reason"] = choice.finish_reason or state["finish_reason"]
    return state


def _same(streamed: dict, choice) -> None:
    message = choice.message
    assert message.reasoning == message.reasoning_content
    assert (streamed["reasoning"], streamed["content"]) == (message.reasoning or "", message.content or "")
    assert [tuple(c) for c in streamed["calls"].values()] == \
        [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert streamed["finish_reason"] == choice.finish_reason


def test_analysis_is_reasoning_and_final_is_content(app, client):
    body = _body(app, ANSWER, extra_body={"return_token_ids": True})
    reply = client.chat.completions.create(**body)
    (choice,) = reply.choices
    assert (choice.message.reasoning, choice.message.content, choice.finish_reason) == (THOUGHT, "Sunny.", "stop")
    assert choice.message.tool_calls is None
    # the markers were generated as their special tokens, and reached the parser
    assert set(_marker_ids(app)) & set(choice.model_extra["token_ids"]) == {4096, 4097, 4098, 4099}
    assert 0 < reply.usage.completion_tokens_details.reasoning_tokens < reply.usage.completion_tokens
    _same(_stream(client, body), choice)


def test_a_call_is_a_tool_call(app, client):
    body = _body(app, CALL, tools=TOOLS)
    choice = client.chat.completions.create(**body).choices[0]
    assert (choice.message.reasoning, choice.message.content, choice.finish_reason) == (THOUGHT, None, "tool_calls")
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == \
        [("get_weather", '{"city": "Paris"}')]
    _same(_stream(client, body), choice)
    # tool_choice none: calls are not read; the message is content as generated, markers included
    none = client.chat.completions.create(**_body(app, CALL, tools=TOOLS, tool_choice="none")).choices[0]
    assert none.message.tool_calls is None and none.finish_reason == "stop"
    assert none.message.content == CALL[CALL.index("<|start|>"):]


def test_output_cut_by_max_tokens(app, client):
    body = _body(app, ANSWER, max_tokens=16)
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert choice.message.reasoning and THOUGHT.startswith(choice.message.reasoning)
    _same(_stream(client, body), choice)


def test_without_the_parsers_the_markers_are_skipped(app, client):
    ctx = app[1]
    saved = ctx.reasoning_parser, ctx.tool_call_parser, ctx.enable_auto_tool_choice
    ctx.reasoning_parser, ctx.tool_call_parser, ctx.enable_auto_tool_choice = None, None, False
    try:
        choice = client.chat.completions.create(**_body(app, ANSWER)).choices[0]
    finally:
        ctx.reasoning_parser, ctx.tool_call_parser, ctx.enable_auto_tool_choice = saved
    assert choice.message.content == "analysis" + THOUGHT + "assistantfinalSunny."  # what llmc gave before


def test_reasoning_and_calls_sent_back_reach_the_template(app):
    import httpx

    ctx = app[1]
    turn = [*CHAT, {"role": "assistant", "content": None, "reasoning_content": THOUGHT,
                    "tool_calls": [{"id": "call_1", "type": "function",
                                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    got = httpx.post(f"{app[0]}/tokenize", json={"model": MODEL, "messages": turn,
                                                  "chat_template": HARMONY_TEMPLATE}).json()["tokens"]
    expected = [dict(m) for m in turn]
    expected[1] = {**expected[1], "content": "", "thinking": THOUGHT,  # the server's arguments: the JSON text read
                   "tool_calls": [{**turn[1]["tool_calls"][0], "function": {"name": "get_weather",
                                                                             "arguments": {"city": "Paris"}}}]}
    text = ctx.tokenizer.apply_chat_template(expected, chat_template=HARMONY_TEMPLATE, tokenize=False,
                                             add_generation_prompt=True)
    assert ("<|channel|>analysis<|message|>" + THOUGHT + "<|end|><|start|>assistant to=functions.get_weather"
            '<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>') in text
    assert got == ctx.tokenizer.encode(text, add_special_tokens=False)


def test_the_parsers_are_refused_off_gpt_oss(llmc_cli, server_artifact, artifact):
    code, err = llmc_cli("run", server_artifact, "--reasoning-parser", "openai_gptoss")
    assert code == 2 and "--reasoning-parser openai_gptoss reads gpt-oss's harmony output" in err
    assert "LlamaForCausalLM" in err
    code, err = llmc_cli("run", artifact, "--enable-auto-tool-choice", "--tool-call-parser", "openai")
    assert code == 2 and "add --reasoning-parser openai_gptoss" in err
    with pytest.raises(ValueError, match="use --tool-call-parser openai with it, not hermes"):
        build_app(lambda: None, MODEL, enable_auto_tool_choice=True, tool_call_parser="hermes",
                  reasoning_parser="openai_gptoss")
