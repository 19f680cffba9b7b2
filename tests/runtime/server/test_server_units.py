"""The server's pure pieces, without a model: error mapping, logprob formatting, deltas, metrics."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmc.errors import RequestError
from llmc.runtime.outputs import CompletionOutput, RequestOutput
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.server.engine_loop import RequestStream
from llmc.runtime.server.errors import MIN_JSON_LOGPROB, ApiError, as_api_error, json_logprob
from llmc.runtime.server.formatting import DeltaTracker, chat_logprobs, completion_logprobs
from llmc.runtime.server.metrics import ServerMetrics
from llmc.runtime.server.protocol import ChatCompletionRequest, CompletionRequest
from llmc.runtime.server.serving import parse_body


class _Tokenizer:
    def decode(self, token_ids, skip_special_tokens=False):
        return "".join(f"<{t}>" for t in token_ids)


def test_request_errors_name_the_sampling_field():
    with pytest.raises(RequestError) as info:
        SamplingParams(top_k=-5)
    error = as_api_error(info.value)
    assert (error.status_code, error.param) == (400, "top_k")
    assert error.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(("body", "param", "text"), [
    ({"prompt": 5}, "prompt", "expected str or list[str] or list[int] or list[list[int]]"),
    ({"prompt": "x", "seed": "s"}, "seed", "valid integer"),
    ({}, "prompt", "Either prompt or prompt_embeds must be provided and non-empty."),  # vLLM's words
])
def test_validation_errors_name_the_field(body, param, text):
    with pytest.raises(ApiError) as info:
        parse_body(CompletionRequest, body).check()
    assert info.value.param == param and text in info.value.message


def test_chat_content_parts_and_unsupported_fields():
    """Text parts are joined with newlines, as vLLM renders them (chat_utils: "\\n".join of the texts); the
    Responses API's text parts and an assistant's refusal are text; a text part without text is skipped."""
    request = parse_body(ChatCompletionRequest, {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}, {"type": "text"},
                                     {"type": "input_text", "text": "c"}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}, {"type": "output_text", "text": "d"}],
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"}]})
    assert request.template_messages() == [
        {"role": "user", "content": "a\nb\nc"},
        {"role": "assistant", "content": "no\nd",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    image = parse_body(ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]})
    with pytest.raises(ApiError, match="only text parts") as info:
        image.template_messages()
    assert info.value.param == "messages.0.content"
    # image parts are kept for a vision model's template (runtime/multimodal.chat_images)
    parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}, {"type": "text", "text": "a"}]
    image = parse_body(ChatCompletionRequest, {"messages": [{"role": "user", "content": parts}]})
    assert image.template_messages() == [{"role": "user", "content": parts}]
    with pytest.raises(ApiError) as info:
        parse_body(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "tools": [{}]}).check()
    assert info.value.param == "tools.0.function"


def test_echo_with_max_tokens_0_generates_one_token_and_asks_prompt_logprobs():
    request = parse_body(CompletionRequest, {"prompt": "x", "echo": True, "max_tokens": 0, "logprobs": 3})
    request.check()
    params = request.to_sampling_params({})
    assert (params.max_tokens, params.logprobs, params.prompt_logprobs) == (1, 3, 3)
    assert request.wants_prompt_only


def test_json_logprobs():
    assert json_logprob(float("-inf")) == MIN_JSON_LOGPROB
    assert json_logprob(float("nan")) == MIN_JSON_LOGPROB
    assert json_logprob(-1.5) == -1.5


def test_completion_logprobs_shape_and_offsets():
    body, end = completion_logprobs(_Tokenizer(), [(1, None), (22, {22: -0.5, 3: -0.25}), (3, {3: -float("inf")})])
    assert body["tokens"] == ["<1>", "<22>", "<3>"]
    assert body["token_logprobs"] == [None, -0.5, MIN_JSON_LOGPROB]
    assert body["top_logprobs"][0] is None and list(body["top_logprobs"][1]) == ["<3>", "<22>"]  # most likely first
    assert body["text_offset"] == [0, 3, 7] and end == 10


def test_top_logprobs_keep_the_higher_of_two_tokens_of_one_text():
    """Byte pieces that each decode to U+FFFD: the text's entry keeps the higher logprob (vLLM), so
    lm-eval's is_greedy (the token's logprob against the best of top_logprobs) is False for token 5
    when token 4, of the same text, is more likely."""
    class Bytes(_Tokenizer):
        def decode(self, token_ids, skip_special_tokens=False):
            return "\ufffd" if token_ids[0] in (4, 5) else super().decode(token_ids)

    body, _ = completion_logprobs(Bytes(), [(5, {4: -1.32, 5: -1.33, 9: -3.0})])
    assert body["top_logprobs"] == [{"\ufffd": -1.32, "<9>": -3.0}]
    assert body["token_logprobs"][0] < max(body["top_logprobs"][0].values())  # not greedy


def test_echo_logprobs_and_prompt_logprobs_each_keep_their_own_count():
    """echo + logprobs 0 beside prompt_logprobs 3: the engine scores the prompt with the larger k, the
    echo's top_logprobs show the token and its 0 best, prompt_logprobs its 3 best and the token."""
    from llmc.runtime.outputs import Logprob
    from llmc.runtime.server.formatting import prompt_logprobs

    request = parse_body(CompletionRequest, {"prompt": "x", "echo": True, "max_tokens": 0, "logprobs": 0,
                                             "prompt_logprobs": 3})
    assert request.to_sampling_params({}).prompt_logprobs == 3
    candidates = {7: Logprob(-3.0, 5), 1: Logprob(-0.5, 1), 2: Logprob(-1.0, 2), 3: Logprob(-2.0, 3)}
    output = RequestOutput("r", "x", [9, 7], [CompletionOutput(0, "", [], None, None)], False,
                           prompt_logprobs=[None, candidates])
    body, _ = completion_logprobs(_Tokenizer(), [(9, None), (7, candidates)], num_top=request.logprobs)
    assert body["top_logprobs"][1] == {"<7>": -3.0}
    (_, entry) = prompt_logprobs(_Tokenizer(), output, request.prompt_logprobs)
    assert list(entry) == ["1", "2", "3", "7"] and entry["7"]["rank"] == 5
    (_, entry) = prompt_logprobs(_Tokenizer(), output, 1)
    assert list(entry) == ["1", "7"]


def test_chat_logprobs_keep_top_n():
    body = chat_logprobs(_Tokenizer(), [7], [{7: -2.0, 8: -0.1, 9: -1.0}], num_top=2)
    (entry,) = body["content"]
    assert entry["token"] == "<7>" and entry["logprob"] == -2.0 and entry["bytes"] == list(b"<7>")
    assert [t["token"] for t in entry["top_logprobs"]] == ["<8>", "<9>"]


def test_delta_tracker_sends_only_what_is_new():
    tracker = DeltaTracker()
    assert tracker.is_first((0, 0))
    assert tracker.delta((0, 0), "ab", [1, 2]) == ("ab", slice(0, 2))
    assert not tracker.is_first((0, 0))
    assert tracker.delta((0, 0), "abc", [1, 2, 3]) == ("c", slice(2, 3))
    assert tracker.delta((0, 1), "x", [9]) == ("x", slice(0, 1))


def _output(num_tokens: int, finished: bool) -> RequestOutput:
    completion = CompletionOutput(0, "t" * num_tokens, list(range(num_tokens)), None, None,
                                  "length" if finished else None)
    return RequestOutput("r", "p", [5, 6, 7], [completion], finished)


def test_metrics_are_per_app_and_count_tokens_and_latencies():
    first, second = ServerMetrics("a"), ServerMetrics("b")  # no clash: each has its own registry
    stream = RequestStream("r", queue=None, tag=0, arrival_time=10.0)
    first.on_output(stream, _output(1, False), now=10.5, step_start=10.2)
    first.on_output(stream, _output(3, True), now=10.7, step_start=10.6)
    text = first.render().decode()
    assert 'llmc:prompt_tokens_total{model_name="a"} 3.0' in text
    assert 'llmc:generation_tokens_total{model_name="a"} 3.0' in text
    assert 'llmc:time_to_first_token_seconds_sum{model_name="a"} 0.5' in text
    assert 'llmc:request_queue_time_seconds_sum{model_name="a"}' in text
    assert 'llmc:request_success_total{finished_reason="length",model_name="a"} 1.0' in text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert math.isclose(samples["llmc:e2e_request_latency_seconds_sum"], 0.7)
    assert samples["llmc:inter_token_latency_seconds_count"] == 1
    # every finish reason's series exists from the start; an aborted request is counted under "abort"
    assert 'llmc:request_success_total{finished_reason="abort",model_name="a"} 0.0' in text
    first.on_abort(RequestStream("s", queue=None, tag=0, arrival_time=11.0), now=11.25)
    text = first.render().decode()
    assert 'llmc:request_success_total{finished_reason="abort",model_name="a"} 1.0' in text
    assert 'llmc:e2e_request_latency_seconds_count{model_name="a"} 2.0' in text
    assert b'model_name="a"' not in second.render()


def _nullable_fields(typed_dict) -> list[str]:
    import typing

    return [name for name, hint in typing.get_type_hints(typed_dict).items() if type(None) in typing.get_args(hint)]


def test_every_field_openai_declares_nullable_takes_null():
    """Clients send `null` for what they leave unset (`"logprobs": null`, `"n": null`, `"stream": null`):
    every field the openai SDK's request types declare Optional parses with null, as its default
    (but a completion's max_tokens, whose null means up to the context, as in vLLM)."""
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params

    cases = [
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]},
         _nullable_fields(chat_create_params.CompletionCreateParamsNonStreaming)),
        (CompletionRequest, {"prompt": "x"},
         [f for f in _nullable_fields(completion_create_params.CompletionCreateParamsNonStreaming) if f != "prompt"]),
    ]
    for request_type, body, fields in cases:
        assert {"n", "logprobs", "stream", "temperature", "seed"} <= set(fields)
        default = parse_body(request_type, body).to_sampling_params({})
        for field in fields:
            request = parse_body(request_type, {**body, field: None})
            request.check()
            if (request_type, field) != (CompletionRequest, "max_tokens"):
                assert request.to_sampling_params({}) == default, field
            assert request.stream is False


def test_the_model_s_generation_defaults_fill_only_the_fields_a_request_leaves_unset():
    """vLLM's generation_config "auto": the model's temperature, top_p, top_k, min_p, repetition_penalty and
    max_new_tokens are the defaults of requests that do not set them (completions keep OpenAI's 16 tokens
    unless max_tokens is null)."""
    defaults = {"temperature": 0.3, "top_p": 0.9, "top_k": 5, "repetition_penalty": 1.2, "max_tokens": 12}
    completion = parse_body(CompletionRequest, {"prompt": "x", "top_p": 0.5}).to_sampling_params(defaults)
    assert (completion.temperature, completion.top_p, completion.top_k, completion.repetition_penalty,
            completion.max_tokens, completion.min_p) == (0.3, 0.5, 5, 1.2, 16, 0.0)
    unbounded = parse_body(CompletionRequest, {"prompt": "x", "max_tokens": None}).to_sampling_params(defaults)
    assert unbounded.max_tokens == 12
    chat = parse_body(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "temperature": 0})
    params = chat.to_sampling_params(defaults)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.0, 5, 12)
    asked = parse_body(ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 40})
    assert asked.to_sampling_params(defaults).max_tokens == 40
    # beam search takes only the temperature (vLLM's to_beam_search_params): a model's repetition penalty
    # would refuse every beam request
    beams = parse_body(CompletionRequest, {"prompt": "x", "n": 2, "use_beam_search": True}).to_sampling_params(defaults)
    assert (beams.temperature, beams.repetition_penalty, beams.top_k, beams.use_beam_search) == (0.3, 1.0, 0, True)
    plain_beams = parse_body(CompletionRequest, {"prompt": "x", "n": 2, "use_beam_search": True}).to_sampling_params({})
    assert plain_beams.temperature == 0.0


def test_the_engine_s_max_logprobs_bounds_the_logprob_fields():
    for request_type, body, field in [(CompletionRequest, {"prompt": "x", "logprobs": 25}, "logprobs"),
                                      (CompletionRequest, {"prompt": "x", "prompt_logprobs": 25}, "prompt_logprobs"),
                                      (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                                                               "logprobs": True, "top_logprobs": 25}, "top_logprobs")]:
        parse_body(request_type, body).check(30)  # an engine started with max_logprobs 30
        with pytest.raises(ApiError, match=r"between 0 and 20 \(this server's max_logprobs\)") as info:
            parse_body(request_type, body).check()
        assert info.value.param == field


def test_chat_template_options_on_a_plain_prompt_are_refused():
    """/tokenize with a prompt has no template to apply them to: a 400 naming the option, not silence."""
    from llmc.runtime.server.protocol import TokenizeRequest

    parse_body(TokenizeRequest, {"prompt": "x"}).check()
    with pytest.raises(ApiError) as info:
        parse_body(TokenizeRequest, {"prompt": "x", "add_generation_prompt": False}).check()
    assert info.value.param == "add_generation_prompt"
    parse_body(TokenizeRequest, {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False}).check()


def test_request_chat_templates_need_the_servers_trust_and_echo_on_chat_is_refused(ref_model_dir):
    """vLLM refuses a chat_template sent in a request unless started with --trust-request-chat-template;
    chat's echo (vLLM: the last message prepended to the reply) is not implemented: a 400, not ignored."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from llmc.runtime.server.serving import ServingContext

    tokenizer = AutoTokenizer.from_pretrained(ref_model_dir)
    loop = SimpleNamespace(tokenizer=tokenizer)
    messages = [{"role": "user", "content": "hi"}]
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ApiError, match="--trust-request-chat-template") as info:
        ServingContext(loop, "m").render_chat(messages, {"chat_template": template})
    assert info.value.param == "chat_template"
    trusted = ServingContext(loop, "m", trust_request_chat_template=True).render_chat(messages, {"chat_template": template})
    assert trusted == tokenizer.encode("hi", add_special_tokens=False)
    assert ServingContext(loop, "m").render_chat(messages, {"chat_template": None})  # the model's own: no trust needed
    with pytest.raises(ApiError) as info:
        parse_body(ChatCompletionRequest, {"messages": messages, "echo": True})
    assert info.value.param == "echo"
    parse_body(ChatCompletionRequest, {"messages": messages, "echo": False})


def test_an_aborted_stream_stops_counting_as_a_replica_s_load():
    """A router sends each request to the replica with the fewest unfinished streams; an aborted stream
    (client gone) was never marked finished, so it counted as load, and was kept, for ever."""
    from llmc.runtime.server.engine_loop import EngineLoop
    from llmc.runtime.server.router import ReplicaRouter

    class Engine:
        def abort_request(self, request_id):
            pass

    loops = [EngineLoop(Engine), EngineLoop(Engine)]
    router = ReplicaRouter(loops)
    stream = RequestStream("r", queue=None, tag=0, arrival_time=0.0)
    router._streams[0].add(stream)
    loops[0]._streams["r"] = stream
    assert router.num_unfinished(0) == 1
    loops[0]._abort(Engine(), "r")  # what the engine thread runs for an abort
    assert stream.is_finished and router.num_unfinished(0) == 0


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_a_stream_whose_client_left_before_its_first_chunk_is_still_closed(spec_version):
    """Starlette cancels a stream whose client is gone before it iterates it (ASGI 2.3: the disconnect
    listener wins; 2.4: `send` of the response's start fails), and an async generator never started runs
    no `finally`: the engine requests of such a stream were never aborted. The response itself closes now."""
    import asyncio

    from llmc.runtime.server.api_server import ClosingStreamingResponse

    started, closed = [], []

    async def events():
        started.append(True)
        try:
            yield "data: 1\n\n"
        finally:
            closed.append("finally")

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        if spec_version == "2.4":
            raise OSError("the client is gone")
        await asyncio.sleep(0.05)  # the listener sees the disconnect first

    response = ClosingStreamingResponse(events(), lambda: closed.append("on_close"), media_type="text/event-stream")
    scope = {"type": "http", "asgi": {"spec_version": spec_version}}

    async def run():
        try:
            await response(scope, receive, send)
        except Exception:  # noqa: BLE001 - 2.4: Starlette's ClientDisconnect
            pass

    asyncio.run(run())
    assert not started  # the case the generator's own finally cannot cover
    assert closed == ["on_close"]
