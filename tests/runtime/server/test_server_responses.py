"""OpenAI's Responses API (POST /v1/responses) over HTTP with the openai SDK, against an in-process app
serving ref-llama-12m with --enable-auto-tool-choice --tool-call-parser hermes, --enable-responses-store
and an API key. The SDK's pydantic models are the shape oracle (Response, the stream events); the
prompt is the chat path's (usage against the chat endpoint's and /tokenize's counts); streamed and
non-streamed greedy outputs are one Response; max_output_tokens gives `incomplete`; text.format
json_schema output validates; forced function calls, function_call_output reaching the template,
previous_response_id with the store, reasoning items (--reasoning-parser), logprobs, and the 400/404s."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent
from pydantic import TypeAdapter

from llmc.runtime.engine import Engine
from llmc.runtime.server.api_server import build_app
from llmc.runtime.server.engine_loop import _Command
from llmc.runtime.server.protocol import INCLUDE_LOGPROBS, items_to_messages
from llmc.runtime.server.serving_responses import ResponseStore, _OutputBuilder

MODEL = "ref-llama"
KEY = "sk-responses"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": WEATHER,
          "strict": True}]
ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}
JSON_FORMAT = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}}
# renders tool calls (their ids and arguments) and tool messages, which the artifact's own template does not
TOOLS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<call {{ c['id'] }} {{ c['function']['name'] }}>"
    "{{ c['function']['arguments'] | tojson }}{% endfor %}{% if m.get('tool_call_id') %} for {{ m['tool_call_id'] }}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def app(server_artifact, served):
    """(base URL, ServingContext) of the app; a test that switches its reasoning parser puts it back."""
    app = build_app(lambda: Engine(server_artifact, device="cpu"), MODEL, api_key=KEY, log_stats=False,
                    trust_request_chat_template=True, enable_auto_tool_choice=True, tool_call_parser="hermes",
                    enable_responses_store=True)
    with served(app, wait_healthy=True) as base_url:
        yield base_url, app.state.ctx


@pytest.fixture
def client(app) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app[0]}/v1", api_key=KEY, max_retries=0, timeout=120)


def _raw(client, **body) -> dict:
    """The response body as sent, checked against the SDK's Response model."""
    raw = client.responses.with_raw_response.create(**body)
    data = json.loads(raw.text)
    Response.model_validate(data)
    return data


def _events(app, **body) -> list:
    """A stream's events, each checked against the SDK's event models; sequence numbers count up from 0."""
    with httpx.stream("POST", f"{app[0]}/v1/responses", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as reply:
        assert reply.status_code == 200
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    events = [EVENTS.validate_python(json.loads(line[6:])) for line in lines]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def _without_ids(response: Response) -> list[dict]:
    items = []
    for item in response.output:
        item = item.model_dump(exclude_none=True)
        item.pop("id", None)
        item.pop("call_id", None)
        item.pop("parsed_arguments", None)  # the SDK's stream helper parses strict tools' arguments
        items.append(item)
    return items


def _chat_prompt_tokens(client, messages, **extra) -> int:
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, **extra)
    return reply.usage.prompt_tokens


def test_text_response_shape_and_the_chat_prompt(client):
    data = _raw(client, model=MODEL, instructions="Be brief.", input="Hello there", max_output_tokens=6,
                temperature=0, metadata={"k": "v"}, user="u1")
    response = Response.model_validate(data)
    assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
    # cut by max_output_tokens: incomplete, the message too
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    (part,) = message.content
    assert part.type == "output_text" and part.annotations == [] and response.output_text == part.text
    usage = response.usage
    assert usage.output_tokens == 6 and usage.total_tokens == usage.input_tokens + 6
    assert usage.output_tokens_details.reasoning_tokens == 0 and usage.input_tokens_details.cached_tokens >= 0
    # the echoed settings
    assert (response.instructions, response.max_output_tokens, response.temperature) == ("Be brief.", 6, 0.0)
    assert response.metadata == {"k": "v"} and response.user == "u1" and response.tools == []
    assert response.tool_choice == "auto" and response.parallel_tool_calls is True and response.store is True
    assert data["text"] == {"format": {"type": "text"}} and response.previous_response_id is None
    # the prompt is the chat template's, as the chat endpoint renders it
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    assert usage.input_tokens == _chat_prompt_tokens(client, chat)
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
             {"role": "user", "content": "Hello there"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}]
    response = client.responses.create(model=MODEL, input=items, max_output_tokens=1)
    chat = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
            {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "a\nb"}]
    assert response.usage.input_tokens == _chat_prompt_tokens(client, chat)


def test_streamed_response_equals_the_non_streamed_one(client, app):
    body = dict(model=MODEL, input="Is it sunny?", text=JSON_FORMAT, temperature=0, max_output_tokens=40)
    whole = client.responses.create(**body)
    assert whole.status == "completed" and whole.completed_at is not None
    jsonschema.validate(json.loads(whole.output_text), ANSWER)
    with client.responses.stream(**body) as stream:
        streamed = stream.get_final_response()
    assert streamed.output_text == whole.output_text and _without_ids(streamed) == _without_ids(whole)
    assert streamed.usage.output_tokens == whole.usage.output_tokens and streamed.status == "completed"
    assert streamed.text.format.type == "json_schema"
    assert client.responses.retrieve(streamed.id).output_text == whole.output_text  # a streamed one is kept too
    events = _events(app, **body)
    kinds = [e.type for e in events]
    assert kinds[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text


def test_incomplete_stream_ends_with_response_incomplete(app):
    events = _events(app, model=MODEL, input="Tell me a story", max_output_tokens=5, temperature=0)
    final = events[-1]
    assert final.type == "response.incomplete" and final.response.status == "incomplete"
    assert final.response.incomplete_details.reason == "max_output_tokens"
    assert final.response.usage.output_tokens == 5


def test_forced_function_call_and_its_output_round_trip(client):
    response = client.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS, temperature=0,
                                       tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60)
    assert response.status == "completed"
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert response.tools[0].name == "get_weather" and response.tools[0].parameters == WEATHER
    assert response.tool_choice.name == "get_weather"
    # "auto" (the default with tools): the server's hermes parser reads the output; the 12M model writes no call
    auto = client.responses.create(model=MODEL, input="Weather?", tools=TOOLS, max_output_tokens=3, temperature=0)
    assert auto.tool_choice == "auto" and [item.type for item in auto.output] == ["message"]
    # the streamed call is the same
    with client.responses.stream(model=MODEL, input="Weather in Paris?", tools=TOOLS, temperature=0,
                                 tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60) as s:
        kinds = [event.type for event in s]
        streamed = s.get_final_response()
    assert _without_ids(streamed) == _without_ids(response)
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    # "required": a call of one of the tools
    required = client.responses.create(model=MODEL, input="Weather?", tools=TOOLS, tool_choice="required",
                                       temperature=0, max_output_tokens=80, parallel_tool_calls=False)
    assert [item.type for item in required.output] == ["function_call"]
    # the call and its output reach the chat template as an assistant tool call and a tool message
    items = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    follow = client.responses.create(model=MODEL, input=items, tools=TOOLS, tool_choice="none", max_output_tokens=1,
                                     extra_body={"chat_template": TOOLS_TEMPLATE})
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function",
                 "function": {"name": "get_weather", "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}]
    tokenized = httpx.post(f"{client.base_url}".removesuffix("/v1/") + "/tokenize", headers={"Authorization": f"Bearer {KEY}"},
                           json={"messages": messages, "chat_template": TOOLS_TEMPLATE, "return_token_strs": True}).json()
    assert follow.usage.input_tokens == tokenized["count"]
    rendered = "".join(tokenized["token_strs"]).replace("▁", " ")
    assert call.call_id.replace("_", "") in rendered.replace("_", "") and "sunny" in rendered


def test_previous_response_id_continues_a_stored_response(client):
    first = client.responses.create(model=MODEL, instructions="Be brief.", input="Hi", max_output_tokens=3,
                                    temperature=0)
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    second = client.responses.create(model=MODEL, input="And then?", previous_response_id=first.id,
                                     max_output_tokens=2)
    assert second.previous_response_id == first.id and second.instructions is None  # not carried over (OpenAI's)
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And then?"}]
    assert second.usage.input_tokens == _chat_prompt_tokens(client, chat)
    third = client.responses.create(model=MODEL, input="Go on", previous_response_id=second.id, max_output_tokens=1)
    chat += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Go on"}]
    assert third.usage.input_tokens == _chat_prompt_tokens(client, chat)
    # store false: answered, not kept
    unkept = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.retrieve(unkept.id)
    assert caught.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_unknown")
    assert caught.value.body["param"] == "previous_response_id" and "resp_unknown" in caught.value.body["message"]
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_a_call_cut_mid_arguments_does_not_break_previous_response_id(client):
    """A function_call cut by max_output_tokens before its arguments are JSON is left out of the next turn's
    conversation (before: every follow-up was a 400 blaming `input`, the stored chain dead)."""
    cut = client.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS, temperature=0,
                                  tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=8)
    (call,) = cut.output
    assert cut.status == "incomplete" and call.status == "incomplete"
    with pytest.raises(ValueError):
        json.loads(call.arguments)
    follow = client.responses.create(model=MODEL, input="Go on", previous_response_id=cut.id, max_output_tokens=1)
    chat = [{"role": "user", "content": "Weather in Paris?"}, {"role": "user", "content": "Go on"}]
    assert follow.usage.input_tokens == _chat_prompt_tokens(client, chat)


def test_logprobs_on_the_output_text(client, app):
    body = dict(model=MODEL, input="Hello", max_output_tokens=4, temperature=0, top_logprobs=2,
                include=["message.output_text.logprobs"])
    response = client.responses.create(**body)
    (part,) = response.output[0].content
    assert len(part.logprobs) == 4 and all(len(entry.top_logprobs) == 2 for entry in part.logprobs)
    assert "".join(entry.token for entry in part.logprobs) == part.text
    deltas = [e for e in _events(app, **body) if e.type == "response.output_text.delta"]
    assert sum(len(e.logprobs) for e in deltas) == 4
    assert client.responses.create(model=MODEL, input="Hello", max_output_tokens=2).output[0].content[0].logprobs is None


def test_reasoning_item_with_a_reasoning_parser(client, app):
    ctx = app[1]
    ctx.reasoning_parser = "deepseek_r1"  # no </think> from the 12M model: the whole output is reasoning
    try:
        response = client.responses.create(model=MODEL, input="Think", max_output_tokens=5, temperature=0,
                                           reasoning={"effort": "low"})
        with client.responses.stream(model=MODEL, input="Think", max_output_tokens=5, temperature=0) as stream:
            kinds = [event.type for event in stream]
    finally:
        ctx.reasoning_parser = None
    (item,) = response.output
    assert item.type == "reasoning" and item.summary == [] and item.content[0].type == "reasoning_text"
    assert response.usage.output_tokens_details.reasoning_tokens > 0 and response.reasoning.effort == "low"
    assert "response.reasoning_text.delta" in kinds and "response.reasoning_text.done" in kinds
    assert kinds[-1] == "response.incomplete"


@pytest.mark.parametrize("extra, param", [
    ({"background_options": {"x": 1}}, "background_options"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"include": ["reasoning.encrypted_content"]}, "include.0"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "schema": ANSWER}}}, "text.format.name"),  # the echo lacked it
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content"),
    ({"input": ""}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{x"}]}, "input.0.arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
    ({"text": {"format": {"type": "text"}, "verbosity": "high"}}, "text.verbosity"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tools": [{"type": "function", "name": ""}]}, "tools.0.name"),
    ({"temperature": -1}, "temperature"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
])
def test_refused_requests_name_the_field(client, extra, param):
    body = {"model": MODEL, "input": "Hi", **extra}
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(**body)
    error = caught.value.body
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert "\n" not in error["message"]


def test_a_too_long_request_is_told_the_responses_fields(client):
    """The context-length 400 advised "max_tokens at most N", a field the Responses API does not read."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=10**6)
    error = caught.value.body
    assert error["param"] == "max_output_tokens" and "(max_output_tokens at most" in error["message"], error
    assert "messages" not in error["message"] and "max_tokens" not in error["message"].replace("max_output_tokens", "")


@pytest.mark.parametrize("field", [{"max_tokens": 3}, {"response_format": {"type": "json_object"}}])
def test_chat_fields_are_refused_not_ignored(client, field):
    """Chat's names for output limits and formats were ignored: the output unbounded or unconstrained."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, extra_body=field)
    error = caught.value.body
    assert error["param"] == next(iter(field)) and "Responses API" in error["message"], error


def test_a_named_tool_choice_without_a_name_is_told_the_responses_shape(client):
    """The hint was the chat API's ({"function": {"name"}}), which a Responses request refuses again."""
    for choice in ({"type": "function"}, {"type": "function", "function": {"name": "get_weather"}}):
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model=MODEL, input="Hi", tools=TOOLS, tool_choice=choice)
        error = caught.value.body
        assert error["param"] == "tool_choice.name" and '"function": {' not in error["message"], error
        assert '{"type": "function", "name": NAME}' in error["message"]


def test_unknown_model_and_api_key(client, app):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="other", input="Hi")
    bad = openai.OpenAI(base_url=f"{app[0]}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.responses.create(model=MODEL, input="Hi")


def test_without_the_store_nothing_is_kept(client, app):
    ctx = app[1]
    store, ctx.response_store = ctx.response_store, None
    try:
        response = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1)  # store: true by default
        assert response.store is False  # accepted, not kept (vLLM's)
        for call in (lambda: client.responses.retrieve(response.id),
                     lambda: client.responses.create(model=MODEL, input="Hi", previous_response_id=response.id)):
            with pytest.raises(openai.NotFoundError) as caught:
                call()
            assert "--enable-responses-store" in caught.value.body["message"]
    finally:
        ctx.response_store = store


def test_the_store_keeps_the_last_responses():
    store = ResponseStore(capacity=2)
    for name in "abc":
        store.put({"id": name, "status": "completed"}, [])
    assert store.get("a") is None and store.get("c").response == {"id": "c", "status": "completed"} and len(store) == 2
    assert store.get("c").conversation == [] and store.get("c").input_items == []
    assert store.delete("b") and not store.delete("b")


def test_the_store_drops_finished_responses_before_one_still_generated():
    """Past capacity the oldest record was dropped even while it was still generated (a background response's
    generation aborted, its client's GET a 404) with finished responses in the store: those go first now."""
    aborted = []

    class Generation:
        def abort(self):
            aborted.append(True)

    store = ResponseStore(capacity=2)
    running = store.put({"id": "a", "status": "in_progress"}, [])
    running.generation = Generation()
    store.put({"id": "b", "status": "completed"}, [])
    store.put({"id": "c", "status": "cancelled"}, [])
    assert store.get("a") is running and store.get("b") is None and store.get("c") is not None and not aborted
    store.put({"id": "d", "status": "queued"}, [])
    assert store.get("c") is None and store.get("a") is running and not aborted and len(store) == 2
    store.put({"id": "e", "status": "queued"}, [])  # none finished: the oldest goes, its generation aborted
    assert store.get("a") is None and aborted == [True] and [store.get(r) is not None for r in "de"] == [True, True]


def test_one_assistant_turn_of_items_is_one_chat_message():
    items = [{"type": "message", "role": "user", "content": "q"},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
             {"type": "function_call_output", "call_id": "c1", "output": "one"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]}]
    assert items_to_messages(items) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "Let me look.", "reasoning": "hmm", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": "Done."}]


@pytest.mark.parametrize("flag, env", [(["--enable-responses-store"], {}), ([], {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}),
                                       ([], {})])
def test_the_store_flag_and_vllm_s_variable_reach_the_server(flag, env, server_artifact, monkeypatch):
    from llmc.cli import main
    from llmc.runtime.server import api_server

    seen = {}
    monkeypatch.setattr(api_server, "serve", lambda *args, **kwargs: seen.update(kwargs))
    monkeypatch.delenv("VLLM_ENABLE_RESPONSES_API_STORE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(server_artifact), "--device", "cpu", "--disable-log-stats", *flag])
    assert exit_info.value.code == 0 and seen["enable_responses_store"] is bool(flag or env)


def test_content_then_calls_are_a_message_then_function_call_items():
    """The builder (what both paths use) on a parser's events: the message closes before the first call."""
    builder = _OutputBuilder(with_logprobs=False)
    builder.feed([("content", "Let me "), ("content", "look."), ("call", 0, "f"), ("args", 0, '{"a"'),
                  ("args", 0, ": 1}"), ("call", 1, "g"), ("args", 1, "{}")])
    builder.finish("completed")
    events = [EVENTS.validate_python(event | {"sequence_number": i}) for i, event in enumerate(builder.take_events())]
    assert [(e.type, getattr(e, "output_index", None)) for e in events] == [
        ("response.output_item.added", 0), ("response.content_part.added", 0), ("response.output_text.delta", 0),
        ("response.output_text.delta", 0), ("response.output_text.done", 0), ("response.content_part.done", 0),
        ("response.output_item.done", 0), ("response.output_item.added", 1),
        ("response.function_call_arguments.delta", 1), ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.done", 1), ("response.output_item.done", 1),
        ("response.output_item.added", 2), ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.done", 2), ("response.output_item.done", 2)]
    message, first, second = builder.items
    assert message["content"][0]["text"] == "Let me look." and message["status"] == "completed"
    assert (first["name"], first["arguments"], second["name"], second["arguments"]) == ("f", '{"a": 1}', "g", "{}")
    assert events[6].item.content[0].text == "Let me look." and events[7].item.arguments == ""


def test_a_message_before_a_call_has_the_same_logprobs_streamed_and_not():
    """The message's logprobs (every generated token's) were those up to its close when streamed, all when not:
    the streamed Response differed from the non-streamed one whenever a call followed the text."""
    chunks = [("Hi", [("content", "Hi")]), ("<call>", [("call", 0, "f")]), ("{}", [("args", 0, "{}")])]
    entries = [{"token": t, "logprob": -1.0, "bytes": list(t.encode()), "top_logprobs": []} for t, _ in chunks]
    whole, streamed = _OutputBuilder(with_logprobs=True), _OutputBuilder(with_logprobs=True)
    whole.add_logprobs(entries)
    whole.feed([event for _, events in chunks for event in events])
    for entry, (_, events) in zip(entries, chunks):
        streamed.add_logprobs([entry])
        streamed.feed(events)
    for builder in (whole, streamed):
        builder.finish("completed")
    assert streamed.items[0]["content"][0]["logprobs"] == whole.items[0]["content"][0]["logprobs"] == entries


# ---- background responses, GET while generated, cancel, input_items ------------------------------------

ITEM = TypeAdapter(ResponseItem)
UNFINISHED = ("queued", "in_progress")


@contextlib.contextmanager
def _engine_paused(ctx):
    """The engine thread held between two steps (a command that waits), so that what a test looks at
    cannot move on under it, however fast or slow the machine is."""
    started, release = threading.Event(), threading.Event()

    def hold(engine) -> None:
        started.set()
        release.wait(120)

    ctx.engine_loop._commands.put(_Command(hold))
    assert started.wait(120), "the engine thread did not take the pause"
    try:
        yield
    finally:
        release.set()


def _wait_until(predicate, what: str, timeout: float = 180.0):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _wait_done(client, response_id: str) -> Response:
    return _wait_until(lambda: (lambda r: r if r.status not in UNFINISHED else None)(
        client.responses.retrieve(response_id)), f"{response_id} to finish")


def _wait_all_blocks_free(ctx) -> dict:
    def idle():
        stats = ctx.engine_loop.stats
        return stats if stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"] else None
    return _wait_until(idle, "every KV block to be free")


def test_a_background_response_is_the_foreground_one(client, app):
    body = dict(model=MODEL, input="Tell me a story", max_output_tokens=24, temperature=0)
    foreground = client.responses.create(**body)
    assert foreground.background is False
    data = _raw(client, **body, background=True)
    queued = Response.model_validate(data)
    assert queued.status in UNFINISHED and queued.background is True and queued.output == [] and queued.usage is None
    assert queued.store is True and queued.max_output_tokens == 24
    done = _wait_done(client, queued.id)
    assert done.status == foreground.status == "incomplete" and done.background is True
    assert done.output_text == foreground.output_text and _without_ids(done) == _without_ids(foreground)
    assert done.usage.output_tokens == foreground.usage.output_tokens == 24
    assert done.usage.input_tokens == foreground.usage.input_tokens
    # cancelling a finished one returns it unchanged
    assert client.responses.cancel(done.id).model_dump() == done.model_dump()
    # it continues a conversation as any kept response does
    follow = client.responses.create(model=MODEL, input="Go on", previous_response_id=done.id, max_output_tokens=1)
    assert follow.status == "incomplete"
    _wait_all_blocks_free(app[1])


def test_a_response_is_kept_while_it_is_generated(client, app):
    """GET of a response being generated was a 404 until it finished: it is in_progress, its output so far."""
    ctx = app[1]
    body = dict(model=MODEL, input="Tell me a story", max_output_tokens=40, temperature=0,
                extra_body={"ignore_eos": True})
    with client.responses.stream(**body) as stream:
        events = iter(stream)
        created = next(events)
        assert created.type == "response.created"
        deltas = ""
        for event in events:
            if event.type == "response.output_text.delta":
                deltas += event.delta
                break
        with _engine_paused(ctx):
            current = client.responses.retrieve(created.response.id)
            assert current.status == "in_progress" and current.completed_at is None and current.usage is None
            (message,) = current.output
            assert message.status == "in_progress" and message.content[0].text.startswith(deltas)
        last = list(events)[-1]
    assert last.type == "response.incomplete"  # cut by max_output_tokens (the SDK's helper wants completed)
    final = last.response
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()
    assert final.status == "incomplete" and final.output_text.startswith(current.output_text)


def test_cancel_a_background_response_mid_generation_frees_its_blocks(client, app):
    ctx = app[1]
    total = ctx.engine_loop.stats["num_total_blocks"]
    started = client.responses.create(model=MODEL, input="Tell me a long story", max_output_tokens=200,
                                      temperature=0, background=True, extra_body={"ignore_eos": True})
    assert started.status in UNFINISHED
    _wait_until(lambda: client.responses.retrieve(started.id).output, "the first output")
    with _engine_paused(ctx):
        running = client.responses.retrieve(started.id)
        assert running.status == "in_progress" and running.output[0].status == "in_progress"
        assert ctx.engine_loop.stats["num_free_blocks"] < total  # it holds blocks
        # a response being generated cannot be continued yet
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model=MODEL, input="Go on", previous_response_id=started.id)
        assert caught.value.body["param"] == "previous_response_id" and "in_progress" in caught.value.body["message"]
        cancelled = client.responses.cancel(started.id)
        assert cancelled.status == "cancelled" and cancelled.background is True
        (message,) = cancelled.output
        assert message.status == "incomplete" and message.content[0].text.startswith(running.output_text)
        assert len(message.content[0].text) > 0
    stats = _wait_all_blocks_free(ctx)
    assert stats["num_free_blocks"] == total
    after = client.responses.retrieve(started.id)
    assert after.model_dump() == cancelled.model_dump()  # the generation stopped: nothing more was written
    assert client.responses.cancel(started.id).model_dump() == cancelled.model_dump()  # again: unchanged
    assert ctx.response_store.get(started.id).task is None


def test_a_cancelled_response_keeps_the_logprobs_of_its_text(client, app):
    """include message.output_text.logprobs: the snapshot of a response being generated, and the response left when
    it was cancelled, had its text with no logprobs at all (logprobs []), where a finished one has every token's."""
    ctx = app[1]
    started = client.responses.create(model=MODEL, input="Tell me a long story", max_output_tokens=200, temperature=0,
                                      top_logprobs=1, include=[INCLUDE_LOGPROBS], background=True,
                                      extra_body={"ignore_eos": True})
    _wait_until(lambda: client.responses.retrieve(started.id).output_text, "the first output text")
    with _engine_paused(ctx):
        running = client.responses.retrieve(started.id)
        cancelled = client.responses.cancel(started.id)
    for response in (running, cancelled):
        (part,) = response.output[0].content
        assert part.text and part.logprobs, (response.status, part)
        assert "".join(entry.token for entry in part.logprobs).startswith(part.text)
        assert all(len(entry.top_logprobs) == 1 for entry in part.logprobs)
    assert cancelled.status == "cancelled" and cancelled.output[0].content[0].text == running.output_text
    _wait_all_blocks_free(ctx)


def test_cancel_errors(client):
    foreground = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.cancel(foreground.id)
    error = caught.value.body
    assert "Only background responses can be cancelled" in error["message"] and error["param"] == "response_id"
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.cancel("resp_unknown")
    assert caught.value.body["param"] == "response_id"


def test_background_needs_the_store_and_no_stream(client, app):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="Hi", background=True, store=False)
    assert caught.value.body["param"] == "background" and "store" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="Hi", background=True, stream=True)
    assert caught.value.body["param"] == "stream" and "background" in caught.value.body["message"]
    ctx = app[1]
    store, ctx.response_store = ctx.response_store, None
    try:
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model=MODEL, input="Hi", background=True)
        error = caught.value.body
        assert error["param"] == "background" and "--enable-responses-store" in error["message"]
        assert "\n" not in error["message"]
        with pytest.raises(openai.NotFoundError):
            client.responses.cancel("resp_x")
        with pytest.raises(openai.NotFoundError):
            client.responses.input_items.list("resp_x")
    finally:
        ctx.response_store = store


@pytest.mark.parametrize("query, param", [({"stream": "true"}, "stream"), ({"starting_after": "3"}, "starting_after"),
                                          ({"include[]": INCLUDE_LOGPROBS}, "include")])
def test_streamed_retrieve_is_refused_by_name(client, app, query, param):
    response = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
    reply = httpx.get(f"{app[0]}/v1/responses/{response.id}", params=query,
                      headers={"Authorization": f"Bearer {KEY}"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_input_items_list_pages_through_the_items_sent(client):
    sent = [{"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
            {"type": "function_call", "id": "fc_given", "call_id": "call_1", "name": "get_weather",
             "arguments": '{"city": "Paris", "days": 1}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"role": "assistant", "content": "Sunny."},
            {"role": "user", "content": "And tomorrow?"}]
    response = client.responses.create(model=MODEL, input=sent, tools=TOOLS, tool_choice="none", max_output_tokens=1,
                                       extra_body={"chat_template": TOOLS_TEMPLATE})
    page = client.responses.input_items.list(response.id)  # desc, 20 by default
    raw = json.loads(client.responses.input_items.with_raw_response.list(response.id).text)
    assert raw["object"] == "list" and raw["has_more"] is False
    items = [ITEM.validate_python(item) for item in raw["data"]][::-1]  # ascending: as sent
    assert [item.id for item in page.data] == [item["id"] for item in raw["data"]]
    assert (raw["first_id"], raw["last_id"]) == (raw["data"][0]["id"], raw["data"][-1]["id"])
    assert [item.type for item in items] == ["message", "message", "function_call", "function_call_output",
                                             "message", "message"]
    assert [getattr(item, "role", None) for item in items] == ["developer", "user", None, None, "assistant", "user"]
    assert items[0].content[0].type == "input_text" and items[0].content[0].text == "Be brief."
    assert items[1].content[0].text == "Weather in Paris?" and items[5].content[0].text == "And tomorrow?"
    assert items[4].content[0].type == "output_text" and items[4].content[0].text == "Sunny."
    assert items[2].id == "fc_given" and items[2].call_id == "call_1" and items[3].id.startswith("fco_")
    assert items[3].output == "sunny" and items[0].id.startswith("msg_") and items[0].status == "completed"
    assert len({item.id for item in items}) == 6
    ids = [item.id for item in items]
    # ascending pages of 4: the SDK follows `after` through has_more
    first = client.responses.input_items.list(response.id, order="asc", limit=4)
    assert [item.id for item in first.data] == ids[:4] and first.has_more is True
    assert [item.id for item in client.responses.input_items.list(response.id, order="asc", limit=4)] == ids
    second = client.responses.input_items.list(response.id, order="asc", limit=4, after=ids[3])
    assert [item.id for item in second.data] == ids[4:] and second.has_more is False
    desc = client.responses.input_items.list(response.id, limit=2, after=ids[4])
    assert [item.id for item in desc.data] == [ids[3], ids[2]] and desc.has_more is True
    before = client.responses.input_items.list(response.id, order="asc", limit=2, extra_query={"before": ids[3]})
    assert [item.id for item in before.data] == ids[1:3] and before.has_more is True
    included = client.responses.input_items.list(response.id, include=[INCLUDE_LOGPROBS])
    assert [item.id for item in included.data] == ids[::-1]
    # a string input is one user message
    single = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
    (item,) = client.responses.input_items.list(single.id).data
    assert item.type == "message" and item.role == "user" and item.content[0].text == "Hi" and item.id.startswith("msg_")


@pytest.mark.parametrize("query, param", [({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"limit": "x"}, "limit"),
                                          ({"order": "up"}, "order"), ({"after": "msg_nope"}, "after"),
                                          ({"before": "msg_nope"}, "before"), ({"include": "bogus"}, "include"),
                                          ({"page": 2}, "page")])
def test_input_items_list_errors(client, query, param):
    response = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.input_items.list(response.id, extra_query=query)
    error = caught.value.body
    assert error["param"] == param and "\n" not in error["message"], error
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")
