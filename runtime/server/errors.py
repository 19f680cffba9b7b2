"""Errors of the HTTP API, in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

`ApiError` carries the HTTP status. Everything a client can get wrong becomes one (400 naming the
field, 401, 404, 503); `as_api_error` maps the engine's `RequestError` and pydantic's validation
errors onto it, so no bad request ever reaches the engine thread as an exception of another kind.
"""

from __future__ import annotations

import math
import re

from pydantic import ValidationError

from llmc.errors import LlmcError, RequestError

_TYPE_FOR_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "server_error",
    503: "service_unavailable_error",
}
# SamplingParams' messages read "SamplingParams.<field> must be ...": the field is the param.
_PARAM_IN_MESSAGE = re.compile(r"SamplingParams\.(\w+)")
# JSON has no infinities: a logprob of -inf (a token masked by logit_bias) is sent as this.
MIN_JSON_LOGPROB = -9999.0


class ApiError(LlmcError):
    """A request the server refuses, with the HTTP status and OpenAI's error fields."""

    def __init__(self, status_code: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status_code, self.message, self.param, self.code)


def error_body(status_code: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object: `code` is a string naming the error (`context_length_exceeded`,
    `model_not_found`, ...) or null, never the HTTP status (that is the response's status)."""
    error_type = _TYPE_FOR_STATUS.get(status_code, "invalid_request_error" if status_code < 500 else "server_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def invalid(param: str, message: str) -> ApiError:
    """400 for one field: `message` says what is allowed."""
    return ApiError(400, f"{param}: {message}", param=param)


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, headers={"Retry-After": "1"})


def as_api_error(error: Exception) -> ApiError:
    """The ApiError for an exception raised while parsing or admitting a request."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, ValidationError):
        return _from_validation_error(error)
    if isinstance(error, RequestError):  # the request's own field names, not the Python class's
        match = _PARAM_IN_MESSAGE.search(str(error))
        return ApiError(400, _PARAM_IN_MESSAGE.sub(r"\1", str(error)), param=match.group(1) if match else error.param)
    if isinstance(error, LlmcError):
        return ApiError(400, str(error))
    return ApiError(500, f"internal error: {type(error).__name__}: {error}")


def _from_validation_error(error: ValidationError) -> ApiError:
    """400 naming the first bad field. A value that fits no member of a union (prompt: str or
    list[int] or ...) gets one message listing the members, instead of one error per member."""
    errors = error.errors()
    path, tag = _split_loc(errors[0]["loc"])
    param = ".".join(map(str, path)) or None
    if tag is not None:
        tags = dict.fromkeys(t for p, t in (_split_loc(e["loc"]) for e in errors) if p == path and t)
        return ApiError(400, f"{param}: expected {' or '.join(tags)}", param=param)
    count = len(errors)
    more = f" (and {count - 1} more problem{'s' if count > 2 else ''})" if count > 1 else ""
    return ApiError(400, f"{param or 'body'}: {errors[0]['msg']}{more}", param=param)


def _split_loc(loc: tuple) -> tuple[tuple, str | None]:
    """(field path, union member tag or None): pydantic puts a union member's type in the location
    (("prompt", "list[int]", 2)); the field path is what comes before it."""
    for i, part in enumerate(loc):
        if isinstance(part, str) and ("[" in part or part in _TYPE_TAGS):
            return tuple(loc[:i]), part
    return tuple(loc), None


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def json_logprob(value: float) -> float:
    """A logprob JSON can carry: -inf and nan become MIN_JSON_LOGPROB."""
    return value if math.isfinite(value) else MIN_JSON_LOGPROB
