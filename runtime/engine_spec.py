"""The engine's speculative step (DESIGN §5): synchronous, drafts verified against known tokens.

Functions of the engine's state, as engine_faults.py's are: `speculative_step` replaces the
launch / resolve pair of a normal step when speculation is configured; `propose_drafts` gives the
sequences that just progressed their drafts for the next step: n-gram drafts, or a draft model's
placeholders, which the scheduler reserves KV slots for and the draft model (runtime/spec_draft.py) or
EAGLE-3 head (runtime/spec_eagle.py) fills in before the target's forward; the head also reads each step's
hidden states right after its sampling (`EagleProposer.absorb`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from llmc.runtime.outputs import RequestOutput
from llmc.runtime.request import RequestStatus
from llmc.runtime.request_state import SequenceState
from llmc.runtime.sampler import SamplingMetadata
from llmc.runtime.scheduler import ScheduledBatch
from llmc.runtime.spec_decode import sample_with_drafts
from llmc.runtime.spec_eagle import EagleProposer
from llmc.runtime.structured_output import mask_verify_rows

if TYPE_CHECKING:
    from llmc.runtime.engine import Engine


def speculative_step(engine: Engine, batch: ScheduledBatch) -> list[RequestOutput]:
    """Run `batch` (its decode rows carry drafts), sample every verified position, update the
    scheduler, check stops and return the step's outputs."""
    num_prefill = engine._mark_scheduled(batch)
    if engine.proposer.fills_drafts:
        engine.proposer.fill(batch)
    step = engine.runner.execute(batch)
    sampled = [s for s in batch.requests if s.is_last_chunk]
    states = [engine.sequences[s.request.request_id] for s in sampled]
    tokens, no_token_allowed = _sample_with_drafts(engine, step.logits.float(), states,
                                                   [s.draft_token_ids for s in sampled])
    if isinstance(engine.proposer, EagleProposer):  # the head's rows of this step, while its blocks are the requests'
        engine.proposer.absorb(batch, {state.request.request_id: t for state, t in zip(states, tokens)})
    for state, blocked in zip(states, no_token_allowed):
        if blocked:  # it ends after its tokens: the scheduler need not append them
            engine.scheduler.finish_request(state.request.request_id, RequestStatus.FINISHED_STOPPED)
    updates = {state.request.request_id: t for state, t in zip(states, tokens)}
    engine._release_rows(engine.scheduler.update(batch, updates))
    failed, kept, num_generated = engine._record_prompt_logprobs(step.prompt_logits), [], 0
    for state, new_tokens, blocked in zip(states, tokens, no_token_allowed):
        if state.request.request_id not in engine.sequences:  # failed recording its prompt logprobs
            continue
        num_before = len(state.detokenizer.output_token_ids)
        errors = engine._guarded(state, engine._check_stop, state, new_tokens, blocked)
        failed += errors
        kept += [] if errors else [state]
        # the tokens the sequence kept: accepted drafts after a stop string are dropped, and not counted (as
        # the overlapped engine's token after a stop is not)
        num_generated += len(state.detokenizer.output_token_ids) - num_before
    propose_drafts(engine, kept)
    engine.stats_logger.record(num_prefill, num_generated, engine.stats)
    return failed + engine._collect_outputs(kept)


def _sample_with_drafts(engine: Engine, logits: torch.Tensor, states: list[SequenceState],
                        drafts: list[list[int]]) -> tuple[list[list[int]], list[bool]]:
    """New tokens per sampled sequence: the accepted drafts plus one (one without drafts), and
    whether the sequence had no token allowed after them (`SpeculativeOutput.no_token_allowed`)."""
    if not states:
        return [], []
    metadata = SamplingMetadata(
        params=[s.params for s in states],
        prompt_token_ids=[s.request.known_prompt_token_ids for s in states],
        output_token_ids=[s.request.output_token_ids for s in states],
        eos_token_ids=engine.eos_token_ids,
    )
    # logprobs come from the logits with the grammars' masks only (vLLM v1 bans bad words after them)
    raw = logits.clone() if any(s.params.logprobs is not None for s in states) else None
    mask_verify_rows(logits, states, drafts, raw)  # bad words, and grammars walking the drafts
    output = sample_with_drafts(logits, metadata, drafts, engine.spec_generator, raw)
    engine.spec_stats.record(drafts, output.token_ids, output.no_token_allowed)
    tokens = [state.cut_at_stop_token(t, engine.eos_token_ids) for state, t in zip(states, output.token_ids)]
    for state, new_tokens, new_logprobs in zip(states, tokens, output.logprobs):
        for i, token in enumerate(new_tokens):
            state.record_logprobs(token, None if new_logprobs is None else new_logprobs[i])
    return tokens, output.no_token_allowed


def propose_drafts(engine: Engine, states: list[SequenceState]) -> None:
    """Drafts for the next step (n-gram tokens, or a draft model's placeholders), unless speculation
    is off or the batch is too large."""
    speculative = engine.options.speculative
    if engine.proposer is None or not speculative.is_enabled_for(engine.scheduler.num_running):
        return
    k = speculative.num_speculative_tokens
    for state in states:
        request = state.request
        if request.is_finished or request.num_tokens - request.num_computed_tokens != 1:
            continue
        room = request.max_tokens - request.num_output_tokens - 1  # the verify step emits one more
        if engine.proposer.fills_drafts:
            request.spec_token_ids = [0] * max(0, min(k, room))  # values: the proposer's fill
        else:
            request.spec_token_ids = engine.proposer.propose(request.all_token_ids)[: min(k, room)]
