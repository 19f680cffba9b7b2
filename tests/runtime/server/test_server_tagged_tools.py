"""The glm45, glm47, qwen3_coder, deepseek_v3, deepseek_v31, minimax_m2 and kimi_k2 tool call parsers and the glm45,
deepseek_v3, minimax_m2, minimax_m2_append_think and kimi_k2 reasoning parsers over HTTP with
the openai client, against an in-process app serving ref-llama-12m with --enable-auto-tool-choice: the 12M
model writes no calls by itself, so its output is forced with guided_choice (as test_server_tools does) to
each format's calls written by hand from the published chat templates. The reply's calls (typed by the
request's tool schemas), content and finish_reason, and the stream's pieces joined, must be the same."""

from __future__ import annotations

import openai
import pytest

from llmc.runtime.engine import Engine
from llmc.runtime.server.api_server import build_app

MODEL = "ref-llama"
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
         {"type": "function", "function": {"name": "ping"}}]
CALLS = [("get_weather", '{"city": "Paris", "days": 3}'), ("ping", "{}")]
B, E = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
C, CE, S = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
KB, KE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KC, KCE, KA = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"
KIMI_K2 = f'{KB}{KC}functions.get_weather:0{KA}{{"city": "Paris", "days": 3}}{KCE}{KE}'
GLM45 = ("Checking.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
         "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n<tool_call>ping\n</tool_call>")
FORMATS = {
    "glm45": GLM45,
    "qwen3_coder": ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=ping>\n"
                    "</function>\n</tool_call>"),
    # one call: DeepSeek's tags take many tokens of the 12M model's vocabulary (several calls: the unit tests)
    "deepseek_v3": f'Checking.{B}{C}function{S}get_weather\n```json\n{{"city": "Paris", "days": 3}}\n```{CE}{E}',
    "glm47": ("Checking.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value><arg_key>days"
              "</arg_key><arg_value>3</arg_value></tool_call><tool_call>ping</tool_call>"),
    "deepseek_v31": f'Checking.{B}{C}get_weather{S}{{"city": "Paris", "days": 3}}{CE}{E}',
    "minimax_m2": ('Checking.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>'
                   '\n<parameter name="days">3</parameter>\n</invoke>\n<invoke name="ping">\n</invoke>\n'
                   "</minimax:tool_call>"),
    "kimi_k2": "Checking." + KIMI_K2,
}
CALLS_OF = {"glm45": CALLS, "qwen3_coder": CALLS, "deepseek_v3": CALLS[:1], "glm47": CALLS, "deepseek_v31": CALLS[:1],
            "minimax_m2": CALLS, "kimi_k2": CALLS[:1]}


@pytest.fixture(scope="module")
def app(server_artifact, served):
    app = build_app(lambda: Engine(server_artifact, device="cpu"), MODEL, log_stats=False,
                    enable_auto_tool_choice=True, tool_call_parser="glm45")
    with served(app, wait_healthy=True) as base_url:
        yield base_url, app.state.ctx


@pytest.fixture
def client(app) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app[0]}/v1", api_key="none", max_retries=0, timeout=120)


def _stream(client, ids: list | None = None, **body) -> dict:
    """The stream's joined reasoning, content, calls [(name, arguments)] and finish_reason of choice 0 (the calls'
    ids appended to `ids`)."""
    joined = {"reasoning": "", "content": "", "calls": {}, "finish_reason": None}
    for chunk in client.chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            joined["reasoning"] += getattr(choice.delta, "reasoning_content", None) or ""
            joined["content"] += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = joined["calls"].setdefault(call.index, [call.function.name, ""])
                if call.id and ids is not None:
                    ids.append(call.id)
                entry[1] += call.function.arguments or ""
            joined["finish_reason"] = choice.finish_reason or joined["finish_reason"]
    joined["calls"] = [tuple(joined["calls"][i]) for i in sorted(joined["calls"])]
    return joined


def _body(text: str, **extra) -> dict:
    return {"model": MODEL, "messages": CHAT, "tools": TOOLS, "max_tokens": 200, "temperature": 0,
            "extra_body": {"guided_choice": [text]}, **extra}


@pytest.mark.parametrize("parser", list(FORMATS))
def test_calls_read_by_each_parser(client, switch, parser):
    switch(tool_call_parser=parser)
    body = _body(FORMATS[parser])
    reply = client.chat.completions.create(**body).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.content == "Checking."
    assert [(c.function.name, c.function.arguments) for c in reply.message.tool_calls] == CALLS_OF[parser]
    assert _stream(client, **body) == {"reasoning": "", "content": "Checking.", "calls": CALLS_OF[parser],
                                       "finish_reason": "tool_calls"}


@pytest.mark.parametrize("parser", ["glm45", "glm47", "kimi_k2"])
def test_glm_parsers_keep_special_tokens_in_the_text(client, switch, parser):
    """vLLM's glm45, glm47 and kimi_k2 parsers turn skip_special_tokens off for requests with tools (their
    adjust_request); the 12M model's <|im_start|> (a special token) stands for a GLM or Kimi tag here."""
    switch(tool_call_parser=parser)
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "temperature": 0, "logit_bias": {"2": 100}}
    assert client.chat.completions.create(**body).choices[0].message.content == ""
    assert client.chat.completions.create(tools=TOOLS, **body).choices[0].message.content == "<|im_start|>" * 2
    assert client.chat.completions.create(tools=TOOLS, tool_choice="none", **body).choices[0].message.content == ""


def test_glm45_reasoning_then_calls(client, switch):
    switch(reasoning_parser="glm45", reasoning_in_structured_output=True)
    body = _body("<think>Paris, in May.</think>" + GLM45)
    reply = client.chat.completions.create(**body).choices[0]
    assert reply.message.reasoning_content == "Paris, in May." and reply.message.content == "Checking."
    assert [(c.function.name, c.function.arguments) for c in reply.message.tool_calls] == CALLS
    assert _stream(client, **body) == {"reasoning": "Paris, in May.", "content": "Checking.", "calls": CALLS,
                                       "finish_reason": "tool_calls"}
    # thinking switched off: the whole output is the answer, its calls read all the same
    off = client.chat.completions.create(**{**body, "extra_body": {
        "guided_choice": ["<think></think>" + GLM45], "chat_template_kwargs": {"enable_thinking": False}}})
    message = off.choices[0].message
    assert getattr(message, "reasoning_content", None) is None and message.content == "<think></think>Checking."
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == CALLS


def test_deepseek_v3_reasoning_only_when_thinking(client, switch):
    """DeepSeek-V3.1's switch: with chat_template_kwargs {"thinking": true} the template opens <think> in
    the prompt and the output is reasoning up to </think>; without it the whole output is the answer."""
    switch(reasoning_parser="deepseek_v3", tool_call_parser="deepseek_v31", reasoning_in_structured_output=True)
    text = "Paris, in May.</think>" + FORMATS["deepseek_v31"]
    body = _body(text, extra_body={"guided_choice": [text], "chat_template_kwargs": {"thinking": True}})
    reply = client.chat.completions.create(**body).choices[0]
    assert reply.message.reasoning_content == "Paris, in May." and reply.message.content == "Checking."
    assert [(c.function.name, c.function.arguments) for c in reply.message.tool_calls] == CALLS[:1]
    assert _stream(client, **body) == {"reasoning": "Paris, in May.", "content": "Checking.", "calls": CALLS[:1],
                                       "finish_reason": "tool_calls"}
    body = _body("Paris, in May.</think>Sunny.")
    del body["tools"]
    off = client.chat.completions.create(**body).choices[0].message
    assert getattr(off, "reasoning_content", None) is None and off.content == "Paris, in May.</think>Sunny."


def test_minimax_m2_reasoning_then_calls(client, switch):
    """MiniMax-M2's template opens <think> in the prompt: minimax_m2 reads the reasoning up to </think>, the calls
    from the answer; minimax_m2_append_think keeps it all in the content, <think> put before it."""
    switch(reasoning_parser="minimax_m2", tool_call_parser="minimax_m2", reasoning_in_structured_output=True)
    body = _body("Paris, in May.</think>" + FORMATS["minimax_m2"])
    reply = client.chat.completions.create(**body).choices[0]
    assert reply.message.reasoning_content == "Paris, in May." and reply.message.content == "Checking."
    assert [(c.function.name, c.function.arguments) for c in reply.message.tool_calls] == CALLS
    assert _stream(client, **body) == {"reasoning": "Paris, in May.", "content": "Checking.", "calls": CALLS,
                                       "finish_reason": "tool_calls"}
    switch(reasoning_parser="minimax_m2_append_think")
    reply = client.chat.completions.create(**body).choices[0]
    assert getattr(reply.message, "reasoning_content", None) is None
    assert reply.message.content == "<think>Paris, in May.</think>Checking."
    assert [(c.function.name, c.function.arguments) for c in reply.message.tool_calls] == CALLS
    assert _stream(client, **body) == {"reasoning": "", "content": "<think>Paris, in May.</think>Checking.",
                                       "calls": CALLS, "finish_reason": "tool_calls"}


def test_kimi_k2_reasoning_then_calls(client, switch):
    """Kimi-K2-Thinking: reasoning up to </think>, or up to a tool call section opened before it (vLLM's implicit
    end); with chat_template_kwargs {"thinking": false} the whole output is the answer, its calls read the same."""
    switch(reasoning_parser="kimi_k2", tool_call_parser="kimi_k2", reasoning_in_structured_output=True)
    for text, content in (("<think>Paris, in May.</think>" + FORMATS["kimi_k2"], "Checking."),
                          ("Paris, in May." + KIMI_K2, None)):
        body, ids = _body(text), []
        reply = client.chat.completions.create(**body).choices[0]
        assert reply.message.reasoning_content == "Paris, in May." and reply.message.content == content
        assert [(c.function.name, c.function.arguments) for c in reply.message.tool_calls] == CALLS[:1]
        assert _stream(client, ids, **body) == {"reasoning": "Paris, in May.", "content": content or "",
                                                "calls": CALLS[:1], "finish_reason": "tool_calls"}
        # the call's id is the model's, streamed or not (vLLM's; Kimi's template writes it back in the history)
        assert [c.id for c in reply.message.tool_calls] == ids == ["functions.get_weather:0"]
    off = client.chat.completions.create(**_body("Paris." + KIMI_K2, extra_body={
        "guided_choice": ["Paris." + KIMI_K2], "chat_template_kwargs": {"thinking": False}})).choices[0].message
    assert getattr(off, "reasoning_content", None) is None and off.content == "Paris."
    assert [(c.function.name, c.function.arguments) for c in off.tool_calls] == CALLS[:1]
