"""Tool calling over HTTP with the openai client, against an in-process app serving ref-llama-12m
with --enable-auto-tool-choice --tool-call-parser hermes: tool_choice named / "required" (outputs
valid against the tools' schemas, checked with jsonschema), "auto" (the 12M model writes no calls
by itself: its output is forced with guided_choice, which "auto" allows, as vLLM does), "none";
streams in vLLM's delta shape whose pieces join to the non-streamed reply; the llama3_json, mistral
and pythonic parsers switched in; n > 1, logprobs and usage; tools reaching the chat template; and
every 400."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from llmc.runtime.engine import Engine
from llmc.runtime.server.api_server import build_app

MODEL = "ref-llama"
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
         {"type": "function", "function": {"name": "ping"}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME, "ping": {"type": "object"}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# A template that renders the tools (the artifact's own does not): they must reach it
TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
                  "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                  "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def app(server_artifact, served):
    """(base URL, ServingContext) of the app; tests that switch its parser put it back."""
    app = build_app(lambda: Engine(server_artifact, device="cpu"), MODEL, log_stats=False,
                    trust_request_chat_template=True, enable_auto_tool_choice=True, tool_call_parser="hermes")
    with served(app, wait_healthy=True) as base_url:
        yield base_url, app.state.ctx


@pytest.fixture
def client(app) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app[0]}/v1", api_key="none", max_retries=0, timeout=120)


def _stream(client, **body) -> tuple[list, dict]:
    """The stream's chunks (parsed by the openai SDK), and per choice index its joined content, calls
    {index: [id, name, arguments]} and finish_reason; asserts vLLM's delta shape on the way."""
    chunks = list(client.chat.completions.create(stream=True, **body))
    choices: dict[int, dict] = {}
    for chunk in chunks:
        assert isinstance(chunk, openai.types.chat.ChatCompletionChunk)
        for choice in chunk.choices:
            state = choices.setdefault(choice.index, {"content": "", "calls": {}, "finish_reason": None,
                                                      "logprobs": 0})
            assert state["finish_reason"] is None, "nothing after a choice's finish"
            state["content"] += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.index not in state["calls"]:  # the first delta of a call: index, id, type, name
                    assert call.id.startswith("chatcmpl-tool-") and call.type == "function" and call.function.name
                    state["calls"][call.index] = [call.id, call.function.name, call.function.arguments or ""]
                else:  # later ones: the next piece of the arguments only
                    assert call.id is None and call.type is None and call.function.name is None
                    state["calls"][call.index][2] += call.function.arguments
            if choice.logprobs is not None:
                state["logprobs"] += len(choice.logprobs.content)
            state["finish_reason"] = choice.finish_reason
    return chunks, choices


def _calls(message) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in message.tool_calls or []]


def test_named_tool_choice_follows_the_function_s_schema(client):
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice=NAMED, n=3,
                                           temperature=1.0, seed=3, max_tokens=60)
    assert isinstance(reply, openai.types.chat.ChatCompletion) and len(reply.choices) == 3
    for choice in reply.choices:
        (call,) = choice.message.tool_calls
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function" and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        assert choice.message.content == "" and choice.finish_reason == "stop"  # vLLM's, for a forced call
    assert len({c.message.tool_calls[0].id for c in reply.choices}) == 3
    # a function without parameters: any JSON object
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, max_tokens=40, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "ping"}})
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "ping" and call.function.arguments.startswith("{")


def test_required_tool_choice_gives_one_call_per_element(client):
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="required", n=4,
                                           temperature=1.0, seed=5, max_tokens=120)
    # the 12M model may go on adding calls until max_tokens: then the last one is cut. An array that ended
    # by itself is "tool_calls" (OpenAI's and vLLM's finish_reason for tool_choice "required"), a cut one "length"
    assert "tool_calls" in {choice.finish_reason for choice in reply.choices}
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": n}, "parameters": s}, "required": ["name", "parameters"]}
        for n, s in SCHEMAS.items()]}}
    for choice in reply.choices:
        assert choice.message.content == "" and choice.finish_reason in ("tool_calls", "length")
        calls = _calls(choice.message)
        whole = calls if choice.finish_reason == "tool_calls" else calls[:-1]
        assert calls and (whole or choice.finish_reason == "length")
        for name, arguments in whole:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        # the output is the array vLLM constrains to: rebuilt from the calls, it validates
        jsonschema.validate([{"name": n, "parameters": json.loads(a)} for n, a in whole] or [{"name": "ping",
                            "parameters": {}}], schema)


@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
def test_streamed_calls_join_to_the_reply(client, tool_choice):
    body = {"model": MODEL, "messages": CHAT, "tools": TOOLS, "tool_choice": tool_choice, "temperature": 1.0,
            "seed": 11, "max_tokens": 80, "n": 2}  # a seed: the stream samples the same tokens
    whole = client.chat.completions.create(**body)
    chunks, streamed = _stream(client, **body)
    assert sorted(streamed) == [0, 1]
    for choice in whole.choices:
        got = streamed[choice.index]
        assert [(name, args) for _, name, args in got["calls"].values()] == _calls(choice.message)
        assert got["content"] == "" and got["finish_reason"] == choice.finish_reason
    # arguments come in several pieces, not in one
    pieces = [c for chunk in chunks for ch in chunk.choices for c in ch.delta.tool_calls or []]
    assert len(pieces) > 2 * len(whole.choices[0].message.tool_calls)


FORCED = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')


def test_auto_reads_hermes_calls_out_of_the_output(client):
    body = {"model": MODEL, "messages": CHAT, "tools": TOOLS, "max_tokens": 200, "temperature": 0,
            "extra_body": {"guided_choice": [FORCED]}}  # tool_choice left out: "auto", as vLLM's default
    reply = client.chat.completions.create(**body)
    (choice,) = reply.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    assert _calls(choice.message) == [("get_weather", '{"city": "Paris", "days": 2}'), ("get_time", '{"zone": "CET"}')]
    _, streamed = _stream(client, **body)
    assert streamed[0]["content"] == "Let me check." and streamed[0]["finish_reason"] == "tool_calls"
    assert [(n, a) for _, n, a in streamed[0]["calls"].values()] == _calls(choice.message)


def test_a_call_cut_by_max_tokens_finishes_with_length(client):
    """A call cut by max_tokens is "length", not "tool_calls" (OpenAI's meaning of finish_reason; vLLM's
    issue 58228: "tool_calls" there hid the cut), so the openai SDK's parse() refuses it."""
    body = {"model": MODEL, "messages": CHAT, "tools": TOOLS, "temperature": 0, "extra_body": {"guided_choice": [FORCED]}}
    whole = client.chat.completions.create(max_tokens=200, logprobs=True, **body).choices[0]
    assert whole.finish_reason == "tool_calls"
    text, budget = "", 0
    for budget, entry in enumerate(whole.logprobs.content, start=1):  # the tokens generated, to cut inside the first call
        text += entry.token
        if '"get_weather"' in text:
            break
    budget += 2
    cut = client.chat.completions.create(max_tokens=budget, **body).choices[0]
    assert cut.finish_reason == "length" and [c.function.name for c in cut.message.tool_calls] == ["get_weather"]
    assert cut.message.tool_calls[0].function.arguments != "{}"  # what was generated of them, no more
    _, streamed = _stream(client, max_tokens=budget, **body)
    assert streamed[0]["finish_reason"] == "length" and len(streamed[0]["calls"]) == 1
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS[:2]]
    with pytest.raises(openai.LengthFinishReasonError):  # the SDK parses strict tools only
        client.chat.completions.parse(max_tokens=budget, **{**body, "tools": strict})


def test_parallel_tool_calls_false_keeps_the_first_call(client):
    """OpenAI's parallel_tool_calls: false, read as vLLM reads it: the first call only, streamed or not."""
    body = {"model": MODEL, "messages": CHAT, "tools": TOOLS, "max_tokens": 200, "temperature": 0,
            "parallel_tool_calls": False, "extra_body": {"guided_choice": [FORCED]}}
    reply = client.chat.completions.create(**body).choices[0]
    assert _calls(reply.message) == [("get_weather", '{"city": "Paris", "days": 2}')]
    assert reply.finish_reason == "tool_calls" and reply.message.content == "Let me check."
    _, streamed = _stream(client, **body)
    assert [(n, a) for _, n, a in streamed[0]["calls"].values()] == _calls(reply.message)
    both = client.chat.completions.create(**{**body, "parallel_tool_calls": True}).choices[0]
    assert len(both.message.tool_calls) == 2
    # "required": the array holds one call (maxItems 1), so it ends after it instead of running to max_tokens
    body = {"model": MODEL, "messages": CHAT, "tools": [TOOLS[2]], "tool_choice": "required", "max_tokens": 60,
            "temperature": 0}
    free = client.chat.completions.create(**body).choices[0]
    assert free.finish_reason == "length" and len(free.message.tool_calls) > 1  # the 12M model goes on calling
    single = client.chat.completions.create(parallel_tool_calls=False, **body).choices[0]
    assert single.finish_reason == "tool_calls" and _calls(single.message) == [("ping", "{}")]


def test_hermes_keeps_special_tokens_in_the_text(client):
    """vLLM's hermes parser turns skip_special_tokens off when tools are given and tool_choice is not
    "none" (vLLM PR 25281): models whose <tool_call> tags are special tokens would otherwise never show a
    call. The 12M model's <|im_start|> (id 2, a special token) stands for such a tag here."""
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "temperature": 0, "logit_bias": {"2": 100}}
    assert client.chat.completions.create(**body).choices[0].message.content == ""  # skipped without tools
    none = client.chat.completions.create(tools=TOOLS, tool_choice="none", **body).choices[0]
    assert none.message.content == ""
    auto = client.chat.completions.create(tools=TOOLS, **body).choices[0]
    assert auto.message.content == "<|im_start|><|im_start|>"
    _, streamed = _stream(client, tools=TOOLS, **body)
    assert streamed[0]["content"] == "<|im_start|><|im_start|>"


def test_mistral_keeps_special_tokens_in_the_text(client, app):
    """So does vLLM's mistral parser: [TOOL_CALLS] and [ARGS] are special tokens of Mistral's tokenizers."""
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "temperature": 0, "logit_bias": {"2": 100}}
    ctx = app[1]
    ctx.tool_call_parser = "mistral"
    try:
        assert client.chat.completions.create(tools=TOOLS, **body).choices[0].message.content == "<|im_start|>" * 2
        assert client.chat.completions.create(tools=TOOLS, tool_choice="none", **body).choices[0].message.content == ""
        ctx.tool_call_parser = "pythonic"
        assert client.chat.completions.create(tools=TOOLS, **body).choices[0].message.content == ""
    finally:
        ctx.tool_call_parser = "hermes"


def test_auto_plain_text_is_content(client):
    body = {"model": MODEL, "messages": CHAT, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 20,
            "temperature": 0, "extra_body": {"guided_choice": ["It is sunny <b>today</b>."]}}
    reply = client.chat.completions.create(**body)
    (choice,) = reply.choices
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == \
        ("It is sunny <b>today</b>.", None, "stop")
    _, streamed = _stream(client, **body)
    assert streamed[0] == {"content": "It is sunny <b>today</b>.", "calls": {}, "finish_reason": "stop", "logprobs": 0}
    # unconstrained, the model's own words: all content, exactly as generated without tools
    free = {"model": MODEL, "messages": CHAT, "max_tokens": 12, "temperature": 0}
    plain = client.chat.completions.create(**free).choices[0]
    with_tools = client.chat.completions.create(tools=TOOLS, tool_choice="none", **free).choices[0]
    auto = client.chat.completions.create(tools=TOOLS, tool_choice="auto", **free).choices[0]
    assert auto.message.content == with_tools.message.content and auto.message.tool_calls is None
    assert auto.finish_reason == with_tools.finish_reason == plain.finish_reason


@pytest.mark.parametrize(("parser", "text", "content"), [
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "ping", "parameters": {}}', None),
    ("mistral", '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}[TOOL_CALLS]ping[ARGS]{}', None),
    ("mistral", 'Checking.[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "ping", '
                '"arguments": {}}]', "Checking."),
    ("pythonic", '[get_time(zone="UTC"), ping()]', None),
    ("llama4_pythonic", '<|python_start|>[get_time(zone="UTC"), ping()]<|python_end|>', None),
    ("ernie45", 'Checking.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
                '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>\n', "Checking."),
    ("granite", '<tool_call>[{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "ping", "arguments": {}}]',
     None),
    ("olmo3", '<function_calls>\nget_time(zone="UTC")\nping()\n</function_calls>', None),
], ids=["llama3_json", "mistral", "mistral-array", "pythonic", "llama4_pythonic", "ernie45", "granite", "olmo3"])
def test_other_parsers(client, app, parser, text, content):
    ctx = app[1]
    ctx.tool_call_parser = parser
    try:
        body = {"model": MODEL, "messages": CHAT, "tools": TOOLS, "max_tokens": 200, "temperature": 0,
                "extra_body": {"guided_choice": [text]}}
        reply = client.chat.completions.create(**body).choices[0]
        assert reply.finish_reason == "tool_calls" and reply.message.content == content
        assert _calls(reply.message) == [("get_time", '{"zone": "UTC"}'), ("ping", "{}")]
        _, streamed = _stream(client, **body)
        assert [(n, a) for _, n, a in streamed[0]["calls"].values()] == _calls(reply.message)
        assert streamed[0]["finish_reason"] == "tool_calls" and streamed[0]["content"] == (content or "")
    finally:
        ctx.tool_call_parser = "hermes"


def test_n_logprobs_and_usage_with_tools(client):
    body = {"model": MODEL, "messages": CHAT, "tools": TOOLS, "tool_choice": "required", "temperature": 1.0,
            "seed": 7, "max_tokens": 60, "n": 2, "logprobs": True, "top_logprobs": 2}
    reply = client.chat.completions.create(**body)
    assert len(reply.choices) == 2
    tokens = [len(c.logprobs.content) for c in reply.choices]
    assert sum(tokens) == reply.usage.completion_tokens and all(tokens)
    assert all(len(entry.top_logprobs) == 2 for c in reply.choices for entry in c.logprobs.content)
    chunks, streamed = _stream(client, stream_options={"include_usage": True}, **body)
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == reply.usage.prompt_tokens
    assert sum(s["logprobs"] for s in streamed.values()) == usage.completion_tokens
    assert all(s["calls"] for s in streamed.values())


def test_tools_reach_the_chat_template(app, client):
    base_url = app[0]
    tokenize = {"model": MODEL, "messages": CHAT, "chat_template": TOOLS_TEMPLATE}
    bare = httpx.post(f"{base_url}/tokenize", json=tokenize).json()
    rendered = httpx.post(f"{base_url}/tokenize", json={**tokenize, "tools": TOOLS}).json()
    text = httpx.post(f"{base_url}/detokenize", json={"model": MODEL, "tokens": rendered["tokens"]}).json()["prompt"]
    assert "Tools: get_weather get_time ping" in text and rendered["count"] > bare["count"]
    for tool_choice in ("none", NAMED):  # "none" renders them too (vLLM's default)
        reply = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice=tool_choice,
                                               max_tokens=30, extra_body={"chat_template": TOOLS_TEMPLATE})
        assert reply.usage.prompt_tokens == rendered["count"]


def test_tools_reach_the_template_as_sent(app):
    """Templates write tools with `tojson` (Qwen 2.5's, vLLM's Llama 3.1 JSON one): a tool renders as the
    client sent it, as transformers' apply_chat_template renders it; one without "type" gets
    "type": "function" first, where vLLM's tool model (type, function) places it."""
    base_url, ctx = app
    template = "{% for t in tools %}{{ t | tojson }}\n{% endfor %}{{ messages[0].content }}"
    tools = [TOOLS[0], {"function": {"name": "ping"}}]
    got = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, "messages": CHAT, "tools": tools,
                                                   "chat_template": template}).json()["tokens"]
    expected = [TOOLS[0], {"type": "function", "function": {"name": "ping"}}]
    text = ctx.tokenizer.apply_chat_template(CHAT, tools=expected, chat_template=template, tokenize=False)
    assert got == ctx.tokenizer.encode(text, add_special_tokens=False)
    assert '{"type": "function", "function": {"name": "ping"}}' in text


def test_llm_chat_takes_tools(server_artifact):
    from llmc.errors import RequestError
    from llmc.runtime.llm import LLM
    from llmc.runtime.sampling_params import SamplingParams

    with LLM(server_artifact, device="cpu") as llm:
        params = SamplingParams(max_tokens=1, temperature=0)
        bare = llm.chat(CHAT, params, chat_template=TOOLS_TEMPLATE)[0]
        with_tools = llm.chat(CHAT, params, chat_template=TOOLS_TEMPLATE, tools=TOOLS)[0]
        text = llm.tokenizer.decode(with_tools.prompt_token_ids)
        assert "Tools: get_weather get_time ping" in text and len(with_tools.prompt_token_ids) > len(bare.prompt_token_ids)
        with pytest.raises(RequestError, match=r"tools\.0\.function\.name"):
            llm.chat(CHAT, params, tools=[{"type": "function", "function": {}}])


BAD = [
    ({"tools": {"type": "function", "function": {"name": "f"}}}, "tools"),
    ({"tools": [3]}, "tools.0"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": 5}}]}, "tools.1.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]}, "tools.0.function.description"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools.0.function.strict"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": NAMED}, "tool_choice"),
    ({"tools": [], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"tools": TOOLS, "tool_choice": {"type": "other", "function": {"name": "ping"}}}, "tool_choice.type"),
    ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"}, "guided_regex"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_json": {"type": "object"}}, "guided_json"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"$ref": "#/properties/a"}}}}}], "tool_choice": "required"},
     "tools.0.function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "use_beam_search": True, "n": 2}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": NAMED, "use_beam_search": True}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
      "tool_choice": "required"}, "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools.0.function.parameters"),
]


@pytest.mark.parametrize(("body", "param"), BAD)
def test_bad_tools_are_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, extra_body=body)
    assert info.value.status_code == 400 and info.value.body["param"] == param and param in info.value.body["message"]


def test_auto_needs_the_server_flags(client, app):
    ctx = app[1]
    ctx.enable_auto_tool_choice = False  # as a server started without --enable-auto-tool-choice
    try:
        for tool_choice in ({}, {"tool_choice": "auto"}):  # left out with tools: "auto"
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, max_tokens=4, **tool_choice)
            assert info.value.body["param"] == "tool_choice"
            assert ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
                    in info.value.body["message"])
        # the other choices need no flag
        reply = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="none", max_tokens=4)
        assert reply.choices[0].message.tool_calls is None
    finally:
        ctx.enable_auto_tool_choice = True


def test_tokenize_refuses_tools_with_a_prompt_and_bad_tools(app):
    base_url = app[0]
    reply = httpx.post(f"{base_url}/tokenize", json={"prompt": "hi", "tools": TOOLS})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tools"
    reply = httpx.post(f"{base_url}/tokenize", json={"messages": CHAT, "tools": [{"function": {"name": None}}]})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tools.0.function.name"


def test_server_flags_are_checked_at_start_up(llmc_cli, tmp_path):
    code, err = llmc_cli("run", tmp_path, "--tool-call-parser", "step3")
    assert code == 2 and all(f"'{name}'" in err for name in ("hermes", "llama3_json", "mistral", "pythonic"))
    code, err = llmc_cli("run", tmp_path, "--enable-auto-tool-choice")
    assert code == 2 and "--enable-auto-tool-choice requires --tool-call-parser" in err
    code, err = llmc_cli("run", tmp_path, "--prompt", "hi", "--tool-call-parser", "hermes")
    assert code == 2 and "--tool-call-parser applies to the server" in err
    with pytest.raises(ValueError, match="supported: hermes, llama3_json, mistral, pythonic"):
        build_app(lambda: None, MODEL, tool_call_parser="step3")


def test_required_takes_pydantic_v1_and_zod_definitions(client):
    """Schemas from pydantic v1 and zod-to-json-schema keep their definitions under "definitions" and refer
    to them as "#/definitions/NAME": with tool_choice "required" (the parameters inside one array) they
    are gathered with the $defs, and the calls follow the tool's schema."""
    unit = {"definitions": {"Unit": {"type": "string", "enum": ["C", "F"]}}, "type": "object",
            "properties": {"unit": {"$ref": "#/definitions/Unit"}}, "required": ["unit"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "temp", "parameters": unit}}]
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, tools=tools, tool_choice="required",
                                           temperature=0, max_tokens=60)
    (choice,) = reply.choices
    calls = _calls(choice.message)
    assert calls and calls[0][0] == "temp"
    jsonschema.validate(json.loads(calls[0][1]), unit)


def test_required_schema_is_vllm_s_array_with_the_tools_defs_at_the_top():
    from llmc.runtime.server.errors import ApiError
    from llmc.runtime.server.protocol import ChatCompletionRequest

    unit = {"$defs": {"unit": {"type": "string", "enum": ["C", "F"]}},
            "type": "object", "properties": {"u": {"$ref": "#/$defs/unit"}}, "required": ["u"]}
    tools = [{"type": "function", "function": {"name": "a", "parameters": unit}},
             {"type": "function", "function": {"name": "b"}}]
    request = ChatCompletionRequest.model_validate({"messages": CHAT, "tools": tools, "tool_choice": "required"})
    schema = request.guided_decoding().json
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["$defs"] == unit["$defs"]
    first, second = schema["items"]["anyOf"]
    assert first["properties"]["name"] == {"type": "string", "enum": ["a"]} and "$defs" not in first["properties"]["parameters"]
    assert second["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert first["required"] == second["required"] == ["name", "parameters"]
    jsonschema.validate([{"name": "a", "parameters": {"u": "C"}}, {"name": "b", "parameters": {}}], schema)
    clash = {**unit, "$defs": {"unit": {"type": "integer"}}}
    tools.append({"type": "function", "function": {"name": "c", "parameters": clash}})
    request = ChatCompletionRequest.model_validate({"messages": CHAT, "tools": tools, "tool_choice": "required"})
    with pytest.raises(ApiError) as info:
        request.guided_decoding()
    assert info.value.param == "tools.2.function.parameters.$defs.unit"
