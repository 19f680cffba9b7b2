"""Multi-step decoding (`num_scheduler_steps`, vLLM v0's name): K decode steps per engine step.

NOTE (algorithm): when every scheduled request decodes one token (no prefill chunk, drafts,
prompt logprobs, logits processors or grammar), the engine runs up to K forwards back to back:
each samples one token per row with the persistent-batch sampler, the scheduler records it
(`advance`, then `resolve` with the value, which is on the host at once on a runner that cannot
overlap) and the next forward reads it as its input. Only then are the window's tokens
detokenized and stop-checked, sequence by sequence, and one output per request is built: the
per-step host work (scheduling, detokenization, stop strings, outputs) runs once per K tokens.

The window never passes a request's length limit (K is cut to the smallest room left), and it
ends early after a step in which some row sampled one of its stop token ids (eos unless
ignore_eos, stop_token_ids) or had no token allowed (`NO_TOKEN`, batch_sampler.py). A stop string inside the window ends its request at the string, as
with K = 1; the tokens computed after it are dropped (their KV slot rows are simply not used
again). Outputs are identical token for token to K = 1: the sampler's per-row state (output
counts, seeded keys) advances once per sampled token either way.

A lone plain-greedy request (batch 1, the edge case) on a runner with `greedy_window` (ONNX) runs
the window's forwards back to back inside the runner, each argmax written into the next call's
bound input, and is recorded afterwards token by token as above (the window's KV room reserved
first): no sampler, scheduler or engine Python between the calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmc.runtime.batch_sampler import NO_TOKEN, HostTokens
from llmc.runtime.outputs import RequestOutput
from llmc.runtime.scheduler import ScheduledBatch

if TYPE_CHECKING:
    from llmc.runtime.engine import Engine


def can_multi_step(engine: Engine, batch: ScheduledBatch) -> bool:
    """Every request of `batch` decodes one token and needs nothing from the host between tokens."""
    if engine.sampler.has_processors or engine.sampler.has_constraints:
        return False
    return all(s.num_new_tokens == 1 and s.is_last_chunk and not s.draft_token_ids and s.request.num_output_tokens > 0
               and not s.request.skip_prefix_cache for s in batch.requests)


def _reserve_tokens(engine: Engine, requests: list, num_tokens: int) -> bool:
    """Give each request the KV blocks of its next `num_tokens` tokens that it lacks (the scheduler
    reserved the window's first); False, allocating nothing, if the pool cannot."""
    pool, block_size = engine.scheduler.block_pool, engine.options.block_size
    needs = [max(0, -(-(r.num_computed_tokens + num_tokens) // block_size) - len(r.block_ids)) for r in requests]
    if not pool.can_allocate(sum(needs)):
        return False
    for request, need in zip(requests, needs):
        if need:  # appended, as the scheduler does: the step buffers' block-table mirror follows
            request.block_ids.extend(block.block_id for block in pool.allocate(need))
    return True


def _greedy_window(engine: Engine, batch: ScheduledBatch, num_steps: int, stop_ids: set[int]) -> list:
    """Batch 1, plain greedy, on a runner with a `greedy_window` (ONNX): the runner runs the window's
    forwards back to back, feeding each argmax to the next call (no sampler, no scheduler between
    them); then the tokens are recorded exactly as the step-by-step loop records them. [] where
    that does not apply, or the pool lacks the window's KV blocks."""
    request = batch.requests[0].request
    if len(batch.requests) != 1 or not hasattr(engine.runner, "greedy_window") or not engine.sampler.is_plain_greedy():
        return []
    num_steps = min(num_steps, engine.options.max_model_len - request.num_tokens)  # the last one ends at the limit
    if num_steps < 1 or not _reserve_tokens(engine, [request], num_steps):
        return []
    tokens = engine.runner.greedy_window(request, num_steps, stop_ids)
    engine.sampler.num_steps += len(tokens)
    for token in tokens:
        engine._release_rows(engine.scheduler.advance(batch))
        engine.scheduler.resolve(request, [token])
    return [([token], None) for token in tokens]


def multi_step(engine: Engine, batch: ScheduledBatch, num_steps: int) -> list[RequestOutput]:
    """Run up to `num_steps` decode steps of `batch`; detokenize, check stops, return outputs."""
    requests = [s.request for s in batch.requests]
    num_steps = min(num_steps, *(r.max_tokens - r.num_output_tokens for r in requests))
    stop_ids = set().union(*(r.sampling_params.all_stop_token_ids(engine.eos_token_ids) for r in requests))
    engine._mark_scheduled(batch)
    window = _greedy_window(engine, batch, num_steps, stop_ids)
    for index in range(0 if window else num_steps):
        if index and not _reserve_tokens(engine, requests, 1):
            break
        step = engine.runner.execute(batch)
        host = HostTokens(engine.sampler.sample(step.logits, step.sample_rows), engine.device)
        engine._release_rows(engine.scheduler.advance(batch))  # a length limit: only at the last step
        token_ids, logprob_rows = host.wait()
        for request, token_id in zip(requests, token_ids):
            if token_id != NO_TOKEN:
                engine.scheduler.resolve(request, [token_id])
        window.append((token_ids, logprob_rows))
        if not stop_ids.isdisjoint(token_ids) or NO_TOKEN in token_ids:
            break
    failed, states, num_generated = [], [], 0
    for i, request in enumerate(requests):
        state, errors = engine.sequences[request.request_id], []
        for token_ids, logprob_rows in window:
            if state.is_finished:  # stopped inside the window: the rest is dropped
                break
            errors = engine._guarded(state, engine._record_token, state, token_ids[i],
                                     None if logprob_rows is None else logprob_rows[i])
            num_generated += token_ids[i] != NO_TOKEN
            if errors:
                break
        failed += errors
        states += [] if errors else [state]
    engine.stats_logger.record(0, num_generated, engine.stats)
    return failed + engine._collect_outputs(states)
