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
