"""What the engine does when something fails: one request's fault ends that request alone.

NOTE (one request, one failure): an exception raised while handling one request (its logits
processor, its sampling row, its detokenization, stop checks or output) is attributed to it: the
engine ends it through `Engine.abort_request` (scheduler, engine maps, KV blocks, prefix-cache
references and its persistent-batch row, in one place) and returns a final `RequestOutput` whose
`error` names the request and the cause. User callables run inside the batched sampler, so each
is wrapped here (`guard_processors`) to raise `RequestFault` carrying its request's id. Anything
else is a fault of the step: the engine fails every request it holds and resets (see
`reset_engine`), so no structure keeps a request another has dropped.

`LLMC_CHECK_INVARIANTS=1` (the test suite sets it) checks after every step that the scheduler,
the engine's maps, the persistent-batch rows and the block pool agree (`check_engine_invariants`).
"""

from __future__ import annotations

import logging
import os

import torch

from llmc.errors import LlmcError
from llmc.runtime.block_pool import BlockPool
from llmc.runtime.outputs import RequestOutput
from llmc.runtime.sampling_params import SamplingParams

CHECK_INVARIANTS_ENV = "LLMC_CHECK_INVARIANTS"

logger = logging.getLogger("llmc")


def invariant_checks_enabled() -> bool:
    return os.environ.get(CHECK_INVARIANTS_ENV, "") not in ("", "0")


class RequestFault(Exception):
    """An exception raised while handling one request (`group_id`, the id the user gave)."""

    def __init__(self, group_id: str, error: BaseException):
        super().__init__(f"request {group_id!r} failed: {type(error).__name__}: {error}")
        self.group_id = group_id
        self.error = error


class RequestFailedError(LlmcError):
    """`LLM.generate`: a request failed (its own fault); `outputs` holds every request's final
    output in prompt order, the failed ones with `error` set."""

    def __init__(self, message: str, outputs: list[RequestOutput]):
        super().__init__(message)
        self.outputs = outputs


def guard_processors(params: SamplingParams, group_id: str) -> None:
    """Wrap `params`' logits processors (a child's own copy) so that an exception in one raises
    RequestFault naming the request. Their arities are kept."""
    if not params.logits_processors:
        return
    params.logits_processors = [_guarded(p, arity, group_id)
                                for p, arity in zip(params.logits_processors, params.logits_processor_arities)]


def _guarded(processor, arity: int, group_id: str):
    def call(*args):
        logits = args[-1]
        try:
            row = processor(*args)
        except Exception as e:  # noqa: BLE001 - the user's callable: attributed to its request
            raise RequestFault(group_id, e) from e
        if not isinstance(row, torch.Tensor) or row.shape != logits.shape:  # it would fail the whole step
            shape = f"a tensor of shape {list(row.shape)}" if isinstance(row, torch.Tensor) else type(row).__name__
            raise RequestFault(group_id, ValueError(f"a logits processor returned {shape}; it must return the "
                                                    f"row's logits, a tensor of shape {list(logits.shape)}"))
        return row

    if arity == 3:
        return lambda prompt_ids, output_ids, logits: call(prompt_ids, output_ids, logits)
    return lambda output_ids, logits: call(output_ids, logits)


def error_output(group, error: BaseException) -> RequestOutput:
    """The final output of a request that failed: no sequences, `error` naming it and the cause."""
    cause = error.error if isinstance(error, RequestFault) else error
    return RequestOutput(
        request_id=group.request_id, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids, outputs=[],
        finished=True, error=f"request {group.request_id!r} failed: {type(cause).__name__}: {cause}",
    )


def fail_request(engine, group_id: str, error: BaseException) -> list[RequestOutput]:
    """End one request that failed (through `engine.abort_request`); [its final output with the error]."""
    group = engine.groups.get(group_id)
    if group is None:  # already ended
        return []
    logger.error("request %r failed, aborting it alone: %s: %s", group_id, type(error).__name__, error,
                 exc_info=error)
    engine.abort_request(group_id)
    return [error_output(group, error)]


def reset_engine(engine, error: BaseException) -> list[RequestOutput]:
    """A step fault no request can be blamed for: fail every request the engine holds and start
    clean (nothing in flight, every row and block free); [their final outputs with the error]."""
    logger.error("engine step failed (%s: %s); failing %d request(s) and resetting the engine",
                 type(error).__name__, error, len(engine.groups), exc_info=error)
    engine._in_flight = None
    outputs = [error_output(group, error) for group in engine.groups.values()]
    for group_id in list(engine.groups):
        engine.abort_request(group_id)
    for request_id in list(engine.scheduler.requests):  # held by the scheduler alone (a bug): cleaned too
        engine.scheduler.abort_request(request_id)
    engine.sequences.clear()
    pool = engine.scheduler.block_pool
    if pool.num_free_blocks != pool.num_blocks:  # blocks no request holds: a fresh pool (the cache is lost)
        logger.error("%d KV blocks held by no request after the reset; rebuilding the block pool",
                     pool.num_blocks - pool.num_free_blocks)
        engine.scheduler.block_pool = BlockPool(pool.num_blocks, pool.block_size, pool.enable_prefix_caching)
    num_rows = engine.options.max_num_seqs
    for row in range(num_rows):
        engine.sampler.remove(row)
    engine._free_rows = list(reversed(range(num_rows)))
    engine.num_resets += 1
    return outputs


def check_engine_invariants(engine) -> None:
    """Raise AssertionError if the scheduler, the engine's maps, the rows and the blocks disagree."""
    scheduler = engine.scheduler
    scheduler.check_invariants()
    for request_id, request in scheduler.requests.items():
        _check(request_id in engine.sequences, f"the scheduler holds {request_id!r}, unknown to the engine")
        _check(engine.sequences[request_id].request is request, f"{request_id!r}: two Request objects")
    for request_id, state in engine.sequences.items():
        _check(request_id in scheduler.requests or state.request.is_finished,
               f"the engine holds {request_id!r}, neither scheduled nor finished")
        _check(state.group_id in engine.groups, f"{request_id!r} belongs to no request group")
    rows = [r.batch_row for r in scheduler.requests.values() if r.batch_row is not None]
    rows += [s.request.batch_row for s in engine.sequences.values()
             if s.request.is_finished and s.request.batch_row is not None]
    _check(len(rows) == len(set(rows)), "two requests share a persistent-batch row")
    _check(sorted(rows + engine._free_rows) == list(range(engine.options.max_num_seqs)),
           "persistent-batch rows lost or duplicated")
    if not scheduler.requests and engine._in_flight is None:
        pool = scheduler.block_pool
        _check(pool.num_free_blocks == pool.num_blocks, "an idle engine holds KV blocks")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(f"engine invariant violated: {message}")
