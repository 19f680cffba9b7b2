"""The scheduler with what beam search needs: forked block tables, copy-on-write, held sequences.

NOTE (forks and copy-on-write, as vLLM v0's BlockSpaceManager did it): a beam that continues with
several tokens is forked: each extra child is a new `Request` whose block table is a copy of its
parent's, every block's ref count incremented (`BlockPool.fork`), so the prompt's and the common
tokens' KV exist once. The full blocks are only read from then on; the parent's last block, partly
filled, is shared too, and the first sequence that writes into it while another still holds it
gets a fresh block and the old one's K/V copied into it first (`ScheduledBatch.blocks_to_copy`,
run by the runner before the step's forward): copy on write at the last block. The last holder
writes in place. A finished or pruned beam frees its table: each block's ref count goes down.

NOTE (held sequences): beams of one search advance together (each round scores every live beam's
extensions). A beam whose round is scored while a sibling has not computed its own yet (the
sibling was preempted, or waits for a seat) is *held*: out of `running`, keeping its blocks and
its seat, never scheduled, until `extend` gives it its next token. When a step has nothing to run
while sequences are held and others wait (the held ones' blocks are what the waiting need), every
held sequence except those of the search at the queue's head is preempted by recompute (to the queue's
tail), so that search completes its round: searches wait rather than deadlock.
"""

from __future__ import annotations

import bisect

from llmc.runtime.block_pool import check_invariant
from llmc.runtime.request import Request, RequestStatus
from llmc.runtime.scheduler import ScheduledBatch, Scheduler


class BeamScheduler(Scheduler):
    """`Scheduler` plus fork / hold / extend for beam search; non-beam requests run as before."""

    def __init__(self, config):
        super().__init__(config)
        self.held: dict[str, Request] = {}  # RUNNING beams waiting for their siblings' round
        self._copies: list[tuple[int, int]] = []  # (src, dst) blocks of the step being scheduled
        self.num_block_copies = 0  # copy-on-write copies so far

    # ---- beam operations (between steps) --------------------------------------------------

    def retract_last_token(self, request: Request) -> int:
        """Take back the token a beam just sampled (its KV is not computed); returns it."""
        if request.num_pending_tokens or request.num_computed_tokens != request.num_tokens - 1:
            raise ValueError(f"retract_last_token: {request.request_id} has no uncomputed last token")
        return request.output_token_ids.pop()

    def hold(self, request: Request) -> None:
        """Keep a running beam's blocks and seat but schedule it no more until `extend`."""
        self.running.remove(request)
        self.held[request.request_id] = request

    def extend(self, request: Request, token_id: int) -> None:
        """A beam's next token (chosen on the host); a held beam runs again."""
        request.output_token_ids.append(token_id)
        if self.held.pop(request.request_id, None) is not None:
            bisect.insort(self.running, request, key=self._policy_key)

    def fork(self, parent: Request, child_id: str, token_id: int) -> Request:
        """A new beam: the parent's tokens plus `token_id`, sharing the parent's blocks (a running
        or held parent, with a seat free) or waiting to be prefilled (no seat, or a waiting parent)."""
        child = Request(
            request_id=child_id, prompt_token_ids=parent.prompt_token_ids, max_tokens=parent.max_tokens,
            arrival_time=parent.arrival_time, priority=parent.priority, sampling_params=parent.sampling_params,
            output_token_ids=parent.output_token_ids + [token_id], skip_prefix_cache=parent.skip_prefix_cache,
            num_cached_tokens=parent.num_cached_tokens, block_hashes=list(parent.block_hashes),
            beam_group_id=parent.beam_group_id,
        )
        self._arrival_index[child_id] = self._num_arrivals
        self._num_arrivals += 1
        self.requests[child_id] = child
        has_seat = self._num_seats_taken() < self.config.max_num_seqs
        if parent.status is RequestStatus.RUNNING and has_seat:
            self.block_pool.fork(self.block_pool.get_blocks(parent.block_ids))
            child.block_ids = list(parent.block_ids)
            child.num_computed_tokens = parent.num_computed_tokens
            self._num_hashed_blocks[child_id] = self._num_hashed_blocks.get(parent.request_id, 0)
            child.status = RequestStatus.RUNNING
            bisect.insort(self.running, child, key=self._policy_key)
        else:
            child.status = RequestStatus.WAITING
            self.waiting.push_front(child)
        return child

    # ---- scheduling -----------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        self._copies = []
        batch = super().schedule()
        released: list[Request] = []
        if batch.is_empty and self.held and self.waiting:
            released = self._release_held(self.waiting.peek())
            batch = super().schedule()
        batch.preempted = released + batch.preempted
        batch.blocks_to_copy, self._copies = self._copies, []
        self.num_block_copies += len(batch.blocks_to_copy)
        return batch

    def _release_held(self, head: Request) -> list[Request]:
        """Nothing can run: the held beams' seats and blocks are what the waiting need. Every held
        beam but those of the head's search is preempted (to the queue's tail: the head's search
        completes its round first); the head's search fits alone (`BeamGroup.start` checks it)."""
        released = [r for r in self.held.values() if r.beam_group_id is None or r.beam_group_id != head.beam_group_id]
        for request in released:
            del self.held[request.request_id]
            self._free_blocks(request)
            request.num_computed_tokens = 0
            request.status = RequestStatus.WAITING
            request.num_preemptions += 1
            self.num_preemptions += 1
            self.waiting.push(request)
        return released

    def _num_seats_taken(self) -> int:
        return len(self.running) + len(self.held)

    def _reserve_blocks(self, request: Request, num_new_tokens: int, preempted: list[Request]) -> bool:
        if not super()._reserve_blocks(request, num_new_tokens, preempted):
            return False
        if request.beam_group_id is None:
            return True
        index = request.num_computed_tokens // self.block_size  # the block this step writes first
        block = self.block_pool.blocks[request.block_ids[index]]
        if block.ref_count == 1:
            return True  # the last holder writes in place
        while not self.block_pool.can_allocate(1):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        if block.ref_count == 1:  # its other holder was just preempted
            return True
        copy = self.block_pool.allocate(1)[0]
        # a new list: the runner's block-table mirror rewrites a row whose list was replaced
        request.block_ids = request.block_ids[:index] + [copy.block_id] + request.block_ids[index + 1:]
        self.block_pool.free([block])
        self._copies.append((block.block_id, copy.block_id))
        return True

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if self.held.pop(request.request_id, None) is not None:
            self.running.append(request)  # where the base class removes a running request from
        super()._finish(request, status)

    # ---- checks -----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """The base checks with held beams counted as running (their blocks and seats)."""
        held = list(self.held.values())
        for request in held:
            check_invariant(request.status is RequestStatus.RUNNING and request.num_pending_tokens == 0
                            and self._num_blocks_to_cover(request.num_computed_tokens) <= len(request.block_ids),
                            f"held {request}: not a running beam with its blocks")
        running = self.running
        self.running = sorted(running + held, key=self._policy_key)
        try:
            super().check_invariants()
        finally:
            self.running = running
