"""The engine's per-request bookkeeping: a request of n sequences (a group) and each sequence's state.

A request with `n` (or `best_of`) > 1 becomes that many scheduler requests sharing one prompt;
with prefix caching, the prompt's KV is computed once and shared.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from llmc.runtime.detokenizer import IncrementalDetokenizer
from llmc.runtime.outputs import CompletionOutput, RequestOutput, with_decoder
from llmc.runtime.request import Request, RequestStatus
from llmc.runtime.sampler import compute_prompt_logprobs
from llmc.runtime.sampling_params import RequestOutputKind, SamplingParams

_STATUS_FOR_REASON = {"stop": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH}


class SequenceState:
    """One generated sequence: its scheduler request, detokenizer and logprobs."""

    def __init__(self, request: Request, index: int, params: SamplingParams, tokenizer,
                 eos_token_ids: list[int], max_model_len: int, group_id: str, stream_interval: int = 1):
        self.request = request
        self.stream_interval = stream_interval  # vLLM's: DELTA outputs every this many tokens (the first at once)
        self.index = index
        self.params = params
        self.group_id = group_id
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, request.known_prompt_token_ids, params, eos_token_ids=eos_token_ids, max_model_len=max_model_len,
            num_prompt_tokens=request.num_prompt_tokens,
        )
        self._decoder = tokenizer if params.detokenize else None  # Logprob.decoded_token, read lazily
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        # prompt_logprobs[p] is the logprob of prompt token p (None for the first, which has no context).
        self.prompt_logprobs: list[dict[int, float] | None] | None = [None] if params.prompt_logprobs is not None else None
        self.cumulative_logprob = 0.0 if params.logprobs is not None else None
        # What DELTA outputs have returned: tokens, characters of text, and whether the finish
        self.num_sent_tokens = 0
        self.num_sent_chars = 0
        self.sent_finish = False

    def record_logprobs(self, token: int, logprobs: dict[int, float] | None) -> None:
        if logprobs is None or self.logprobs is None:
            return
        self.logprobs.append(with_decoder(logprobs, self._decoder))
        self.cumulative_logprob += logprobs[token]

    def record_prompt_logprobs(self, first_position: int, logits: torch.Tensor) -> None:
        """logits [n, vocab_size] at positions first_position.. score prompt tokens first_position+1..
        Positions already recorded (a re-prefill after preemption) are skipped."""
        num_known = len(self.prompt_logprobs) - 1  # positions whose next-token logprob is recorded
        skip = num_known - first_position
        if skip >= logits.shape[0]:
            return
        start = first_position + max(skip, 0)
        next_ids = self.request.prompt_token_ids[start + 1 : first_position + 1 + logits.shape[0]]
        scored = compute_prompt_logprobs(logits[max(skip, 0):], next_ids, self.params.prompt_logprobs)
        self.prompt_logprobs.extend(with_decoder(d, self._decoder) for d in scored)

    def cut_at_stop_token(self, token_ids: list[int], eos_token_ids: list[int]) -> list[int]:
        """Tokens up to and including the first that ends the sequence (speculation may emit more)."""
        stops = set(self.params.stop_token_ids) | (set() if self.params.ignore_eos else set(eos_token_ids))
        num_outputs = self.request.num_output_tokens
        for i, token in enumerate(token_ids):
            if token in stops and num_outputs + i + 1 > self.params.min_tokens:
                return token_ids[: i + 1]
        return token_ids

    def add_tokens(self, token_ids: list[int]) -> None:
        self.detokenizer.add_tokens(token_ids)

    @property
    def finish_status(self) -> RequestStatus | None:
        """Set once the detokenizer decided the sequence is over (eos, stop, length)."""
        reason = self.detokenizer.finish_reason
        return None if reason is None else _STATUS_FOR_REASON.get(reason, RequestStatus.FINISHED_ABORTED)

    @property
    def is_finished(self) -> bool:
        """Its last token is in (a length limit the scheduler saw may still have it in flight)."""
        return self.detokenizer.is_finished or self.request.status is RequestStatus.FINISHED_ABORTED

    def completion(self) -> CompletionOutput:
        """The whole output so far."""
        detok = self.detokenizer
        return CompletionOutput(
            index=self.index,
            text=detok.output_text,
            token_ids=list(detok.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else self.logprobs[: len(detok.output_token_ids)],
            finish_reason=self._finish_reason(),
            stop_reason=detok.stop_reason,
        )

    def delta(self) -> CompletionOutput | None:
        """What was added since the last delta (None if nothing, the finish included)."""
        detok = self.detokenizer
        num_tokens, num_chars = len(detok.output_token_ids), detok.num_output_chars
        finish_reason = self._finish_reason()
        if (num_tokens == self.num_sent_tokens and num_chars == self.num_sent_chars
                and (finish_reason is None or self.sent_finish)):
            return None
        if (finish_reason is None and self.num_sent_tokens > 0
                and num_tokens - self.num_sent_tokens < self.stream_interval):
            return None  # stream_interval: held until that many tokens are new (or it finishes)
        first_token = self.num_sent_tokens
        output = CompletionOutput(
            index=self.index,
            text=detok.output_text_from(self.num_sent_chars),
            token_ids=detok.output_token_ids[first_token:],
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else self.logprobs[first_token:num_tokens],
            finish_reason=finish_reason,
            stop_reason=detok.stop_reason,
        )
        self.num_sent_tokens, self.num_sent_chars = num_tokens, num_chars
        self.sent_finish = finish_reason is not None
        return output

    def _finish_reason(self) -> str | None:
        finish_reason = self.detokenizer.finish_reason
        if finish_reason is None and self.request.status == RequestStatus.FINISHED_ABORTED:
            finish_reason = "abort"
        return finish_reason


@dataclass
class RequestGroup:
    """A user request: one prompt, n returned sequences (best_of generated)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    sequences: list[SequenceState] = field(default_factory=list)
    first_scheduled_time: float | None = None  # time.monotonic() of its first step
    prompt_logprobs_sent: bool = False  # DELTA: the first output (which carries them) was returned
    prompt_embeds: torch.Tensor | None = None  # the prompt given as embeddings (its token ids are placeholders)

    def mark_scheduled(self, now: float) -> None:
        if self.first_scheduled_time is None:
            self.first_scheduled_time = now

    def child_params(self) -> list[SamplingParams]:
        """Per-sequence params: n = 1 each; seeded requests give sequence i the seed + i."""
        num_sequences = self.params.best_of or self.params.n
        wants_ranking = num_sequences > self.params.n and self.params.logprobs is None
        children = []
        for i in range(num_sequences):
            # seed + i mod 2**64: the same seed to the sampler (int64_seed), never above 2**64 - 1, never -1 (no seed)
            seed = None if self.params.seed is None else (self.params.seed + i) % 2**64
            children.append(dataclasses.replace(
                self.params, n=1, best_of=None, seed=seed, logprobs=0 if wants_ranking else self.params.logprobs,
                prompt_logprobs=self.params.prompt_logprobs if i == 0 else None,
            ))
        return children

    @property
    def is_finished(self) -> bool:
        sequences = self.sequences
        return sequences[0].is_finished if len(sequences) == 1 else all(s.is_finished for s in sequences)

    def output(self) -> RequestOutput | None:
        """This step's output, as the request's output_kind asks: None for a FINAL_ONLY request
        still running, or a DELTA request none of whose sequences progressed."""
        is_finished = self.is_finished
        kind = self.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not is_finished:
            return None
        prompt_logprobs = self.sequences[0].prompt_logprobs
        if kind is RequestOutputKind.DELTA:
            completions = [c for c in (s.delta() for s in self.sequences) if c is not None]
            if not completions and not is_finished:
                return None
            if self.prompt_logprobs_sent:
                prompt_logprobs = None
            self.prompt_logprobs_sent = True
        else:
            completions = [s.completion() for s in self.sequences]
        if is_finished and len(completions) > self.params.n:
            # best_of: keep the n sequences the model found most likely.
            completions.sort(key=lambda c: c.cumulative_logprob, reverse=True)
            completions = completions[: self.params.n]
            if self.params.logprobs is None:
                completions = [dataclasses.replace(c, logprobs=None, cumulative_logprob=None) for c in completions]
            # The kept sequences are the request's outputs 0..n-1, whichever of best_of they were.
            completions = [dataclasses.replace(c, index=i) for i, c in enumerate(completions)]
        first = self.sequences[0]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=None if self.prompt_embeds is not None else self.prompt_token_ids,
            outputs=completions,
            finished=is_finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=first.request.num_cached_tokens,
            metrics={"arrival_time": self.arrival_time, "first_scheduled_time": self.first_scheduled_time},
            prompt_embeds=self.prompt_embeds,
        )
