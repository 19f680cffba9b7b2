"""What generation returns, shaped as vLLM's `RequestOutput` / `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sequence of a request (a request with n > 1 has n of them)."""

    index: int  # which of the request's n sequences
    text: str  # generated text so far (stop string excluded unless include_stop_str_in_output)
    token_ids: list[int]  # generated token ids so far
    cumulative_logprob: float | None  # sum of the sampled tokens' logprobs, when logprobs were computed
    logprobs: list[dict[int, float]] | None  # per generated token: {token id: logprob}, when asked
    finish_reason: str | None = None  # "stop" | "length" | "abort", None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after a step: prompt, sequences, and whether it is finished."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, float] | None] | None = None  # per prompt token (first is None)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: dict = field(default_factory=dict)  # arrival, first token, finish times (seconds)
    error: str | None = None  # set (finished, no outputs) when the request failed: what went wrong
