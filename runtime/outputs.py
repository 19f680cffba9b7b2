"""What generation returns, shaped as vLLM's `RequestOutput` / `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor


class Logprob(float):
    """vLLM's `Logprob`, as the float it holds: `.logprob` (the value), `.rank` (1 for the distribution's
    most likely token) and `.decoded_token` (the token's text, decoded when first read; None where the
    request asked for no text). It compares and computes as a float, so code that reads logprobs as
    numbers (`sum(...)`, `d[t] < 0`, JSON) sees no difference."""

    __slots__ = ("rank", "_decoded")

    def __new__(cls, logprob: float, rank: int | None = None, decoded: object = None):
        self = super().__new__(cls, logprob)
        self.rank = rank
        self._decoded = decoded  # None, the text, or (tokenizer, token id) to decode on first read
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    @property
    def decoded_token(self) -> str | None:
        if isinstance(self._decoded, tuple):
            tokenizer, token_id = self._decoded
            self._decoded = tokenizer.decode([token_id])
        return self._decoded

    def __reduce__(self):
        return Logprob, (float(self), self.rank, self.decoded_token)


def with_decoder(logprobs: dict[int, Logprob] | None, tokenizer) -> dict[int, Logprob] | None:
    """Give each entry its token's text, decoded by `tokenizer` when first read (`Logprob.decoded_token`);
    no tokenizer (a request without detokenization): left without text."""
    if tokenizer is None:
        return logprobs
    for token_id, value in (logprobs or {}).items():
        if isinstance(value, Logprob) and value._decoded is None:
            value._decoded = (tokenizer, token_id)
    return logprobs


@dataclass
class CompletionOutput:
    """One generated sequence of a request (a request with n > 1 has n of them)."""

    index: int  # which of the request's n sequences
    text: str  # generated text so far (stop string excluded unless include_stop_str_in_output)
    token_ids: list[int]  # generated token ids so far
    cumulative_logprob: float | None  # sum of the sampled tokens' logprobs, when logprobs were computed
    logprobs: list[dict[int, Logprob]] | None  # per generated token: {token id: Logprob (a float)}, when asked
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
    prompt_token_ids: list[int] | None  # None for a prompt given as embeddings (prompt_embeds)
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # per prompt token (first is None)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: dict = field(default_factory=dict)  # arrival, first token, finish times (seconds)
    error: str | None = None  # set (finished, no outputs) when the request failed: what went wrong
    prompt_embeds: Tensor | None = None  # the prompt, when given as embeddings (vLLM's; runtime/prompt_embeds.py)

    @property
    def num_prompt_tokens(self) -> int:
        """The prompt's length in tokens, whether given as token ids or as embeddings."""
        return len(self.prompt_token_ids) if self.prompt_token_ids is not None else len(self.prompt_embeds)
