"""Beam search inside the engine: a request with `use_beam_search` is a group of long-lived beams.

NOTE (one round): every live beam is a scheduler request whose last token is not computed yet. A
step computes it, and the sampler returns the top 2 * beam_width logprobs (raw log-softmax) plus
the sampled token's; when every live beam of the group has reported its round, the group scores
each beam's extensions (cumulative logprob / length ** length_penalty, the length counting the
prompt and not a final eos: vLLM's `get_beam_search_score`), extensions ending in eos (unless
ignore_eos) are complete, and the best `beam_width` others are the next live beams, in score
order (ties keep the beams' order, then the logprobs' order, as vLLM's sort). The sampled token
is taken back first (`BeamScheduler.retract_last_token`); a beam with no surviving extension is
pruned (its request aborted: blocks freed); one with k extensions continues with the first
(`extend`) and is forked k - 1 times (`fork`: its block table shared, copy on write at its last
block, runtime/beam_scheduler.py). A beam whose round is in while a sibling's is not (preempted,
or waiting for a seat) is held. After `max_tokens` rounds (or max_model_len) the live beams end
by length and the group returns its `n` best complete or live beams, best first.

Beam rows make every step synchronous (the next input token is chosen on the host), as grammar
rows do. Non-beam requests take none of these paths.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field

from llmc.errors import RequestError
from llmc.runtime.outputs import CompletionOutput, RequestOutput
from llmc.runtime.request import Request, RequestStatus
from llmc.runtime.request_state import RequestGroup
from llmc.runtime.sampling_params import RequestOutputKind, SamplingParams


def beam_score(tokens: list[int], cum_logprob: float, eos_token_ids: list[int], length_penalty: float) -> float:
    """vLLM's beam score; `tokens` holds the prompt and the generated tokens."""
    length = len(tokens) - (1 if tokens and tokens[-1] in eos_token_ids else 0)
    try:
        return cum_logprob / (length ** length_penalty)
    except (OverflowError, ZeroDivisionError):  # length ** penalty beyond a float (|penalty| in the hundreds): its limit
        if cum_logprob == 0.0:
            return 0.0
        return -math.inf if length_penalty < 0 else -0.0


def check_beam_width(name: str, width: int, max_logprobs: int) -> None:
    """vLLM's bound: a beam search ranks 2 x width logprobs a step, so the width is at most max_logprobs / 2
    (`name`: the field that gave the width, for the error)."""
    if 2 * width > max_logprobs:
        raise RequestError(f"{name} {width}: beam search ranks 2 x beam width logprobs per step, more than its "
                           f"max_logprobs ({max_logprobs}); lower the beam width or raise max_logprobs")


class BeamState:
    """One live beam: its scheduler request and what the group scores it by (the engine's
    per-sequence interface: request, group_id, params, logprobs, record_logprobs, ...)."""

    banned_token_ids: list[int] = []
    constraints = None
    finish_status = None

    def __init__(self, request: Request, params: SamplingParams, group_id: str, cum_logprob: float = 0.0,
                 logprobs: list[dict[int, float]] | None = None):
        self.request = request
        self.params = params
        self.group_id = group_id
        self.cum_logprob = cum_logprob
        self.logprobs: list[dict[int, float]] = logprobs if logprobs is not None else []  # per generated token
        self.report: dict[int, float] | None = None  # this round's {token: logprob}, once computed
        self.is_finished = False  # pruned, or the search ended

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_token_ids + self.request.output_token_ids

    def record_logprobs(self, token: int, logprobs: dict[int, float] | None) -> None:
        self.report = logprobs

    def add_tokens(self, token_ids: list[int]) -> None:
        """The engine's stop checks do not apply: the group ends beams (eos, length)."""


def advance_beam_groups(engine, states: list) -> list[RequestOutput]:
    """The groups whose beams computed a round this step advance; [final outputs of the failed]."""
    reported: dict[str, list[BeamState]] = {}
    for state in states:
        if isinstance(state, BeamState):
            reported.setdefault(state.group_id, []).append(state)
    failed = []
    for group_id, beams in reported.items():
        group = engine.groups.get(group_id)
        if group is not None:  # None: it failed earlier in this step
            failed += engine._guarded(beams[0], group.advance, engine, beams)
    return failed


@dataclass
class BeamResult:
    """A complete or final beam."""

    tokens: list[int]
    cum_logprob: float
    logprobs: list[dict[int, float]]
    finish_reason: str


@dataclass
class BeamGroup(RequestGroup):
    """A `use_beam_search` request: `params.n` beams; `sequences` holds the live ones' states."""

    done: list[BeamResult] = field(default_factory=list)
    is_over: bool = False
    step_params: SamplingParams | None = None
    _num_children: int = 0
    _eos: list[int] = field(default_factory=list)
    _tokenizer: object = None

    def start(self, engine, priority: int) -> None:
        """Queue the first beam (the prompt); refuses what this engine cannot run as beams."""
        params = self.params
        if getattr(engine.runner, "copy_blocks", None) is None:
            raise RequestError("use_beam_search needs the paged KV cache of a single-rank torch runner; this "
                               "engine's (ONNX or tensor/pipeline parallel) cannot copy KV blocks")
        if engine.proposer is not None:
            raise RequestError("use_beam_search does not run with speculative decoding; start without --speculative")
        if params.n > engine.options.max_num_seqs:
            raise RequestError(f"use_beam_search with n={params.n} beams needs n <= max_num_seqs "
                               f"({engine.options.max_num_seqs}); lower n")
        self._eos, self._tokenizer = list(engine.eos_token_ids), engine.tokenizer
        room = engine.options.max_model_len - len(self.prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        block_size, num_blocks = engine.options.block_size, engine.scheduler.config.num_blocks
        num_needed = params.n * -(-(len(self.prompt_token_ids) + max_tokens - 1) // block_size)
        if num_needed > num_blocks:  # beams that cannot all hold their KV at once could thrash forever
            raise RequestError(f"use_beam_search with n={params.n} beams of up to {len(self.prompt_token_ids) + max_tokens} "
                               f"tokens needs up to {num_needed} KV blocks, but the cache has {num_blocks}; lower n or "
                               "max_tokens, or raise num_kv_blocks / gpu_memory_utilization")
        self.step_params = SamplingParams(
            temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, min_p=params.min_p,
            seed=params.seed, ignore_eos=True, max_tokens=max_tokens, logprobs=2 * params.n, detokenize=False)
        request = Request(request_id=f"{self.request_id}#0", prompt_token_ids=self.prompt_token_ids,
                          max_tokens=max_tokens, arrival_time=self.arrival_time, priority=priority,
                          sampling_params=self.step_params, beam_group_id=self.request_id)
        self._add_state(engine, BeamState(request, self.step_params, self.request_id))
        engine.scheduler.add_request(request)

    def _add_state(self, engine, state: BeamState) -> None:
        self.sequences.append(state)
        engine.sequences[state.request.request_id] = state

    # ---- one round --------------------------------------------------------------------------

    def advance(self, engine, reported: list[BeamState]) -> None:
        """Beams of this group computed their round this step: hold them, or score the round."""
        scheduler = engine.scheduler
        for state in reported:
            scheduler.retract_last_token(state.request)
        if any(state.report is None for state in self.sequences):
            for state in reported:
                if state.request.status is RequestStatus.RUNNING and state.request.request_id not in scheduler.held:
                    scheduler.hold(state.request)
            return
        eos = [] if self.params.ignore_eos else engine.eos_token_ids
        candidates = []
        for state in self.sequences:
            for token, logprob in state.report.items():
                result = BeamResult(state.tokens + [token], state.cum_logprob + logprob, state.logprobs + [state.report],
                                    "stop" if token in eos else "length")
                if token in eos:
                    self.done.append(result)
                else:
                    candidates.append((state, token, result))
        score = lambda c: beam_score(c[2].tokens, c[2].cum_logprob, engine.eos_token_ids, self.params.length_penalty)  # noqa: E731
        kept = sorted(candidates, key=score, reverse=True)[: self.params.n]
        if any(state.request.is_finished for state in self.sequences) or not kept:  # the last round
            self.done += [result for _, _, result in kept]
            self.finish(engine)
            return
        self._next_beams(engine, kept)

    def _next_beams(self, engine, kept: list[tuple[BeamState, int, BeamResult]]) -> None:
        """The kept extensions become the live beams, in score order."""
        scheduler, live = engine.scheduler, []
        parents = {id(state) for state, _, _ in kept}
        for state in list(self.sequences):
            if id(state) not in parents:
                self._prune(engine, state)
        first = {}  # id(parent) -> index in `kept` of its first (best) kept extension
        for index, (parent, _, _) in enumerate(kept):
            first.setdefault(id(parent), index)
        for index, (parent, token, result) in enumerate(kept):  # forks first: they copy the parent's tokens
            if first[id(parent)] != index:
                self._num_children += 1
                child = scheduler.fork(parent.request, f"{self.request_id}#{self._num_children}", token)
                live.append(BeamState(child, self.step_params, self.request_id, result.cum_logprob, result.logprobs))
                engine.sequences[child.request_id] = live[-1]
            else:
                live.append(parent)
        for index, (parent, token, result) in enumerate(kept):
            if first[id(parent)] == index:  # the parent itself continues with its best extension
                scheduler.extend(parent.request, token)
                parent.cum_logprob, parent.logprobs, parent.report = result.cum_logprob, result.logprobs, None
        self.sequences[:] = live

    def _prune(self, engine, state: BeamState) -> None:
        engine.scheduler.abort_request(state.request.request_id)
        engine._release_rows([state.request])
        engine.sequences.pop(state.request.request_id, None)
        state.is_finished = True
        self.sequences.remove(state)

    def finish(self, engine) -> None:
        """The search is over: every beam's request ends (blocks freed); `output` is final."""
        for state in list(self.sequences):
            engine.scheduler.abort_request(state.request.request_id)
            engine._release_rows([state.request])
            state.is_finished = True
        self.is_over = True

    # ---- output -----------------------------------------------------------------------------

    @property
    def is_finished(self) -> bool:
        return self.is_over

    def output(self) -> RequestOutput | None:
        """Nothing until the search is over (an output without sequences for CUMULATIVE requests,
        None for the other kinds); then its n best beams, best first."""
        if not self.is_over and self.params.output_kind is not RequestOutputKind.CUMULATIVE:
            return None
        completions = []
        if self.is_over:
            penalty = self.params.length_penalty
            best = sorted(self.done, key=lambda r: beam_score(r.tokens, r.cum_logprob, self._eos, penalty), reverse=True)
            completions = [self._completion(i, result) for i, result in enumerate(best[: self.params.n])]
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
            outputs=completions, finished=self.is_over,
            metrics={"arrival_time": self.arrival_time, "first_scheduled_time": self.first_scheduled_time},
        )

    def _completion(self, index: int, result: BeamResult) -> CompletionOutput:
        generated = result.tokens[len(self.prompt_token_ids):]
        is_eos = result.finish_reason == "stop"
        shown = generated[:-1] if is_eos and not self.params.include_stop_str_in_output else generated
        text = self._tokenizer.decode(shown, skip_special_tokens=self.params.skip_special_tokens) if self.params.detokenize else ""
        return CompletionOutput(index=index, text=text, token_ids=generated, cumulative_logprob=result.cum_logprob,
                                logprobs=result.logprobs, finish_reason=result.finish_reason,
                                stop_reason=generated[-1] if is_eos else None)
