"""stream_options as vLLM reads it: nullable fields, continuous_usage_stats alone turns usage on."""
import pytest

from llmc.runtime.server.protocol import ChatCompletionRequest

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("options, include, continuous", [
    ({"include_usage": True}, True, False),
    ({"include_usage": False, "continuous_usage_stats": True}, False, False),
    ({"continuous_usage_stats": True}, True, True),
    ({"include_usage": None}, False, False),
    ({"include_usage": True, "continuous_usage_stats": None}, True, False),
    ({}, False, False),
])
def test_stream_options(options, include, continuous):
    request = ChatCompletionRequest.model_validate({"messages": MESSAGES, "stream": True, "stream_options": options})
    request.check()
    assert request.include_usage is include
    assert request.continuous_usage is continuous


def test_an_empty_functions_list_asks_for_nothing_as_an_empty_tools_list():
    from llmc.runtime.server.errors import ApiError

    for body in ({"functions": []}, {"tools": []}):
        request = ChatCompletionRequest.model_validate({"messages": MESSAGES, **body})
        request.check()
        assert "functions" not in request.unknown_fields()
    with pytest.raises(ApiError, match="functions"):
        ChatCompletionRequest.model_validate({"messages": MESSAGES, "functions": [{"name": "f"}]}).unknown_fields()
