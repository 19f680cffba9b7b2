"""Fixes of the server and CLI against vLLM's and OpenAI's documented behaviour, without a model
where the check needs none: stop strings, error params, logit_bias clamping, truncate_prompt_tokens -1."""

from __future__ import annotations

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
