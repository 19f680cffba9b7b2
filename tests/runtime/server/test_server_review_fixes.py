"""The server against vLLM's and OpenAI's documented behaviour (without a model where the check needs
none): one long stop string, context-length messages, CORS, a 405's Allow, the params errors name,
truncate_prompt_tokens -1, logit_bias clamping, several served model names."""

from __future__ import annotations

import json

import pytest

from llmc.runtime.server.errors import ApiError
from llmc.runtime.server.protocol import MAX_STOP_STRINGS, ChatCompletionRequest, CompletionRequest
from llmc.runtime.server.serving import parse_body

CHAT = [{"role": "user", "content": "hi"}]


def _checked(model, body: dict):
    request = parse_body(model, body)
    request.check()
    return request


def test_one_long_stop_string_is_accepted():
    """OpenAI's `stop` is a string or up to 4 strings (vLLM: any number): a string's length is not a count."""
    stop = "x" * 69
    request = _checked(CompletionRequest, {"prompt": "a", "stop": stop})
    assert request.to_sampling_params({}).stop == [stop]


def test_too_many_stop_strings_is_one_line_naming_stop():
    with pytest.raises(ApiError) as info:
        _checked(CompletionRequest, {"prompt": "a", "stop": ["s"] * (MAX_STOP_STRINGS + 1)})
    assert info.value.param == "stop"
    assert info.value.message == f"stop: at most {MAX_STOP_STRINGS} stop strings, got {MAX_STOP_STRINGS + 1}"


def _context(max_model_len: int = 256):
    from types import SimpleNamespace

    from llmc.runtime.server.serving import ServingContext

    engine = SimpleNamespace(options=SimpleNamespace(max_model_len=max_model_len))
    return ServingContext(SimpleNamespace(engine=engine), "m")


def test_context_length_errors_read_as_openai_and_vllm_write_them():
    """Clients (LiteLLM) recognise the error by OpenAI's and vLLM's case-sensitive prefix."""
    from llmc.runtime.sampling_params import SamplingParams

    ctx = _context(256)
    with pytest.raises(ApiError) as info:
        ctx.check_prompt_length([1] * 240, SamplingParams(), "messages", 17, "max_completion_tokens")
    error = info.value.body()["error"]
    assert error["message"].startswith(
        "This model's maximum context length is 256 tokens. However, you requested 257 tokens "
        "(240 in the messages, 17 in the completion). Please reduce the length of the messages or completion")
    assert (error["param"], error["code"]) == ("max_completion_tokens", "context_length_exceeded")
    with pytest.raises(ApiError) as info:
        ctx.check_prompt_length([1] * 300, SamplingParams(), "prompt", None)
    error = info.value.body()["error"]
    assert error["message"].startswith("This model's maximum context length is 256 tokens. However, you requested "
                                       "300 tokens in the prompt")
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")


def _app_client(**options):
    """The app without its lifespan (the engine never loads): enough for what does not need it."""
    from starlette.testclient import TestClient

    from llmc.runtime.server.api_server import build_app

    def no_engine():
        raise AssertionError("not started")

    return TestClient(build_app(no_engine, "m", log_stats=False, **options))


def test_cors_allows_any_origin_by_default_as_vllm():
    client = _app_client()
    preflight = client.options("/v1/chat/completions", headers={
        "Origin": "https://ui.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    reply = client.get("/version", headers={"Origin": "https://ui.example"})
    assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == "*"


def test_cors_allowed_origins_limit_them():
    from llmc.runtime.server.api_server import CorsPolicy

    client = _app_client(cors=CorsPolicy(allowed_origins=("https://ui.example",), allow_credentials=True))
    reply = client.get("/version", headers={"Origin": "https://ui.example"})
    assert reply.headers["access-control-allow-origin"] == "https://ui.example"
    assert reply.headers["access-control-allow-credentials"] == "true"
    other = client.get("/version", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_405_names_the_allowed_methods():
    """RFC 9110: a 405 response carries Allow (as FastAPI's own handler, and so vLLM, send it)."""
    reply = _app_client().delete("/version")
    assert reply.status_code == 405 and reply.headers["allow"] == "GET"
    assert reply.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.slow  # 8 s on 2 cores: a server process of its own
def test_llmc_run_cors_flags(start_server, server_artifact):
    import subprocess
    import sys

    import httpx

    server = start_server("--allowed-origins", '["https://ui.example"]', "--allow-credentials", "--disable-log-stats")
    reply = httpx.get(f"{server.base_url}/v1/models", headers={"Origin": "https://ui.example"})
    assert reply.headers["access-control-allow-origin"] == "https://ui.example"
    assert reply.headers["access-control-allow-credentials"] == "true"
    assert server.terminate() == 0
    command = [sys.executable, "-c", "from llmc.cli import main; main()", "run", str(server_artifact)]
    bad = subprocess.run([*command, "--allowed-origins", "https://ui.example"], capture_output=True, text=True)
    assert bad.returncode == 2 and "expected a JSON list" not in bad.stderr and "not valid JSON" in bad.stderr
    bad = subprocess.run([*command, "--allowed-origins", '"*"'], capture_output=True, text=True)
    assert bad.returncode == 2 and "expected a JSON list of strings" in bad.stderr
    other_mode = subprocess.run([*command, "--prompt", "x", "--allow-credentials"], capture_output=True, text=True)
    assert other_mode.returncode == 2 and "--allow-credentials applies to the server" in other_mode.stderr


def _post(server, path: str, body: dict):
    import httpx

    from tests.runtime.server.conftest import API_KEY

    return httpx.post(f"{server.base_url}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)


@pytest.mark.parametrize(("path", "body", "param"), [
    # the chat API's name for the logprobs count is top_logprobs (-1: the whole vocabulary, over max_logprobs)
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [*CHAT, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
    ("/v1/completions", {"prompt": [""], "add_special_tokens": False}, "prompt"),  # no token to start from
])
def test_errors_name_the_request_field(server, path, body, param):
    reply = _post(server, path, {"model": "ref-llama", "max_tokens": 2, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param
    assert error["message"].startswith(f"{param}") and not error["message"].startswith(f"{param}: {param}")


def test_truncate_prompt_tokens_minus_1_keeps_the_model_s_context(server):
    """vLLM's -1: truncate to max_model_len (the last 256 tokens here): a prompt that fits is unchanged; one
    longer is cut to 256 tokens, which leave no room to generate (as in vLLM)."""
    prompt = [10 + i % 50 for i in range(100)]
    body = {"model": "ref-llama", "prompt": prompt, "max_tokens": 3, "temperature": 0}
    plain = _post(server, "/v1/completions", body)
    truncated = _post(server, "/v1/completions", {**body, "truncate_prompt_tokens": -1})
    assert truncated.status_code == 200, truncated.text
    assert truncated.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"] == 100
    assert truncated.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    chat = _post(server, "/v1/chat/completions", {"model": "ref-llama", "messages": CHAT, "max_tokens": 2,
                                                 "truncate_prompt_tokens": -1})
    assert chat.status_code == 200, chat.text
    too_long = _post(server, "/v1/completions", {**body, "prompt": prompt * 3, "truncate_prompt_tokens": -1})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    assert "you requested 256 tokens in the prompt" in too_long.json()["error"]["message"]
    for value in (0, -2):
        reply = _post(server, "/v1/completions", {**body, "truncate_prompt_tokens": value})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "truncate_prompt_tokens"
        assert "SamplingParams" not in reply.json()["error"]["message"]


def test_a_truncated_text_prompt_keeps_its_bos_as_vllm_tokenizes_it(server, ref_model_dir):
    """vLLM tokenizes a text prompt with truncate_prompt_tokens k by the tokenizer's truncation from the
    left: the special tokens it adds (BOS) stay, the text's first tokens go; a token-id prompt and a
    chat's rendered prompt keep their last k (transformers' tokenizer is the reference). The streamed
    chat's first usage counts the cut prompt."""
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(ref_model_dir)
    reference.truncation_side = "left"
    text = "hello world foo bar"
    expected = reference.encode(text, truncation=True, max_length=3)
    assert expected[0] == reference.bos_token_id and len(expected) == 3
    body = {"model": "ref-llama", "prompt": text, "max_tokens": 1, "temperature": 0, "truncate_prompt_tokens": 3,
            "echo": True, "logprobs": 0}
    reply = _post(server, "/v1/completions", body).json()
    assert reply["usage"]["prompt_tokens"] == 3
    assert reply["choices"][0]["logprobs"]["tokens"][:3] == [reference.decode([t]) for t in expected]
    ids = reference.encode(text)
    reply = _post(server, "/v1/completions", {**body, "prompt": ids}).json()
    assert reply["choices"][0]["logprobs"]["tokens"][:3] == [reference.decode([t]) for t in ids[-3:]]
    stream = _post(server, "/v1/chat/completions", {"model": "ref-llama", "messages": CHAT, "max_tokens": 2,
                                                    "truncate_prompt_tokens": 4, "stream": True,
                                                    "stream_options": {"include_usage": True,
                                                                       "continuous_usage_stats": True}})
    chunks = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
    assert {chunk["usage"]["prompt_tokens"] for chunk in chunks if chunk.get("usage")} == {4}


def test_logit_bias_beyond_100_is_clamped_as_vllm_s_server_does():
    """OpenAI documents biases in [-100, 100]; vLLM's server clamps values beyond it instead of refusing them."""
    request = _checked(CompletionRequest, {"prompt": "a", "logit_bias": {"5": 500, "6": -1e9, "7": 2.5}})
    assert request.to_sampling_params({}).logit_bias == {5: 100.0, 6: -100.0, 7: 2.5}
    chat = _checked(ChatCompletionRequest, {"messages": CHAT, "logit_bias": {"5": -101}})
    assert chat.to_sampling_params({}).logit_bias == {5: -100.0}


def test_logit_bias_beyond_100_forces_or_bans_the_token(server):
    body = {"model": "ref-llama", "prompt": "The", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    forced = _post(server, "/v1/completions", {**body, "logit_bias": {"1000": 500}})
    assert forced.status_code == 200, forced.text
    detokenized = _post(server, "/detokenize", {"tokens": [1000] * 3})
    assert forced.json()["choices"][0]["text"] == detokenized.json()["prompt"], detokenized.text


@pytest.mark.slow  # a server of its own: 5 s on 2 cores
def test_several_served_model_names(start_server):
    """vLLM's --served-model-name a b: every name is listed and accepted; a response names the one sent
    (the first when none is)."""
    import httpx

    server = start_server("--served-model-name", "main-name", "alias", "--disable-log-stats")
    assert [card["id"] for card in httpx.get(f"{server.base_url}/v1/models").json()["data"]] == ["main-name", "alias"]
    assert httpx.get(f"{server.base_url}/v1/models/alias").json()["id"] == "alias"
    body = {"prompt": "x", "max_tokens": 1}
    for sent, named in (("alias", "alias"), ("main-name", "main-name"), (None, "main-name")):
        reply = httpx.post(f"{server.base_url}/v1/completions", json={**body, "model": sent}, timeout=60)
        assert reply.status_code == 200 and reply.json()["model"] == named, reply.text
    chat = httpx.post(f"{server.base_url}/v1/chat/completions", json={"model": "alias", "messages": CHAT,
                                                                      "max_tokens": 1}, timeout=60)
    assert chat.json()["model"] == "alias"
    other = httpx.post(f"{server.base_url}/v1/completions", json={**body, "model": "other"})
    assert other.status_code == 404 and "'main-name', 'alias'" in other.json()["error"]["message"]
    assert 'model_name="main-name"' in httpx.get(f"{server.base_url}/metrics").text
    assert server.terminate() == 0


@pytest.mark.parametrize("argv, names, artifact", [
    (["--served-model-name", "a", "ART"], ("a",), "ART"),
    (["--served-model-name", "a", "b", "ART", "--port", "9"], ("a", "b"), "ART"),
    (["--served-model-name=a", "ART"], ("a",), "ART"),
    (["--served-model-name", "a", "--port", "9", "ART"], ("a",), "ART"),
    (["ART", "--served-model-name", "a", "b", "--port", "9"], ("a", "b"), "ART"),
    (["ART", "--served-model-name", "a", "--served-model-name", "b"], ("a", "b"), "ART"),
    (["--served-model-name", "a", "b", "--port", "8000", "ART"], ("a", "b"), "ART"),
    (["--served-model-name", "a", "b", "--chat", "ART"], ("a", "b"), "ART"),
    (["--served-model-name", "a", "b", "--port=8000", "ART"], ("a", "b"), "ART"),
    (["--served-model-name", "a", "b", "--", "ART"], ("a", "b"), "ART"),
])
def test_served_model_names_before_or_after_the_artifact(argv, names, artifact):
    """Several names after one flag (vLLM's nargs="+"), and a name given before ARTIFACT leaves it
    ARTIFACT (it took it as a second name)."""
    from llmc.cli import cli

    ctx = cli.commands["run"].make_context("run", list(argv))
    assert ctx.params["served_model_name"] == names and ctx.params["artifact"] == artifact
