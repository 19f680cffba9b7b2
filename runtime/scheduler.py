"""The unified (vLLM-v1 style) scheduler: one token budget per step, chunked prefill, prefix
caching and preemption by recompute. Plain Python, no tensors.

Protocol, once per engine step:
    batch = scheduler.schedule()            # who computes how many tokens, blocks reserved
    ... forward + sample the requests whose is_last_chunk is True ...
    finished = scheduler.update(batch, {request_id: [token, ...]})
    ... engine-detected stops: scheduler.finish_request(request_id, FINISHED_STOPPED) ...
`update` must see the batch of the latest `schedule` before the next `schedule` is called.
Overlapped scheduling replaces `update` by `advance(batch)` right after the step is launched
(the sampled tokens are pending: counted, values unknown) and `resolve(request, tokens)` once
their values reach the host, possibly after the next `schedule`.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field

from llmc.errors import ConfigError, RequestError
from llmc.runtime.block_pool import BlockPool, KVBlock, check_invariant, hash_block_tokens, sequence_root_hash
from llmc.runtime.request import Request, RequestStatus, WaitingQueue, check_request_can_run

logger = logging.getLogger("llmc")

POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler limits (a boundary object: the engine fills it from the artifact's plan).

    Fields:
        max_num_seqs: most requests running (holding blocks) at once.
        max_num_batched_tokens: token budget of one step, summed over all scheduled requests.
        max_model_len: longest sequence (prompt + generated tokens) a request may reach.
        block_size: tokens per KV block.
        num_blocks: KV blocks in the cache.
        enable_prefix_caching: reuse the KV of full blocks with an equal token prefix.
        policy: "fcfs" (arrival order) or "priority" (lower `Request.priority` first, then arrival).
        enable_chunked_prefill: split a prefill that does not fit the step's remaining budget;
            when False a waiting request is admitted only if its whole prefill fits (this needs
            max_num_batched_tokens >= max_model_len).
        max_loras: most run-time LoRA adapters among the running requests (runtime/lora.py: each needs
            a slot); a waiting request whose adapter would be one more waits, and the ones behind it are
            admitted past it (vLLM v1's rule).
        long_prefill_token_threshold: > 0: at most this many of one request's prompt tokens per step (vLLM's), so
            that a long prompt leaves room in each step for other requests' chunks; 0: the budget alone.
        recompute_last_cached_block: a prefix-cache hit gives one block fewer (vLLM's rule under EAGLE): an EAGLE
            head's row at a position reads the model's hidden state there and the next token, so the row before the
            first computed token needs the model to compute that position (runtime/spec_eagle.py).
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool = True
    policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    max_loras: int = 1
    long_prefill_token_threshold: int = 0
    recompute_last_cached_block: bool = False

    @property
    def max_chunk_tokens(self) -> int:
        """The most tokens of one request a step may compute: the budget, capped by long_prefill_token_threshold."""
        threshold = self.long_prefill_token_threshold
        return min(self.max_num_batched_tokens, threshold) if threshold > 0 else self.max_num_batched_tokens

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
                     "num_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be at least max_model_len ({self.max_model_len}); raise it, lower "
                "max_model_len or enable chunked prefill"
            )


@dataclass
class ScheduledRequest:
    """One request's share of a step.

    Fields:
        request: the request; its `num_computed_tokens` is where this step's tokens start, and
            its `block_ids` already cover them (read both before `update`).
        num_new_tokens: tokens to compute this step: positions
            [request.num_computed_tokens, request.num_computed_tokens + num_new_tokens).
        is_last_chunk: the chunk reaches request.num_tokens, so the engine samples from its last
            position and passes the tokens to `update`; False for a partial prefill.
        draft_token_ids: speculative tokens verified in this step, after the request's own last
            token; they are the last len(draft_token_ids) of num_new_tokens (positions past
            request.num_tokens), and the engine samples at each of them too.
    """

    request: Request
    num_new_tokens: int
    is_last_chunk: bool
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        """One token that ends the request's known tokens: a decode-kernel row."""
        return self.num_new_tokens == 1 and self.is_last_chunk


@dataclass
class ScheduledBatch:
    """What one step computes (a boundary object: the model runner builds its ForwardBatch from it).

    Fields:
        requests: decodes first (`requests[:num_decodes]`, one token each, all sampled), then
            prefill chunks (new prompts, continued chunks, re-prefills after preemption; any
            length >= 1). Within each part, scheduling order: running requests by policy, then
            newly admitted ones by policy.
        num_decodes: how many leading entries of `requests` are decodes.
        num_batched_tokens: sum of num_new_tokens; never above max_num_batched_tokens.
        preempted: requests preempted during this step's scheduling (now WAITING, blocks freed,
            num_computed_tokens 0); the model runner drops any per-request state it keeps.
        blocks_to_copy: (src, dst) KV blocks to copy before the step's forward (copy-on-write of a
            block that forked sequences share, runtime/beam_scheduler.py); empty otherwise.
    """

    requests: list[ScheduledRequest] = field(default_factory=list)
    num_decodes: int = 0
    num_batched_tokens: int = 0
    preempted: list[Request] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    """Decides, each step, which requests compute how many tokens, and owns the block pool."""

    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.block_size = config.block_size
        self.block_pool = BlockPool(config.num_blocks, config.block_size,
                                    config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self._arrival_index: dict[str, int] = {}  # add order: breaks arrival_time ties
        self._num_arrivals = 0
        self._num_hashed_blocks: dict[str, int] = {}  # leading blocks registered in the cache
        is_priority = config.policy == "priority"
        self.waiting = WaitingQueue(self._policy_key if is_priority else None)
        self.running: list[Request] = []  # sorted by _policy_key: preemption victims at the end
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # tokens looked up at admissions (re-prefills included)
        self.prefix_cache_hits = 0  # of those, tokens served from the cache

    # ---- requests in and out ----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a new request; reject it (RequestError) if it could never run."""
        if request.request_id in self.requests:
            raise RequestError(f"request {request.request_id!r} is already queued or running; "
                               "use a unique request id")
        config = self.config
        check_request_can_run(request, config.max_model_len, config.block_size, config.num_blocks)
        self._arrival_index[request.request_id] = self._num_arrivals
        self._num_arrivals += 1
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        self.waiting.push(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Finish a request as aborted and free its blocks now; None if it is unknown/finished."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Finish a request for an engine-detected reason (eos, stop string); frees its blocks.

        Unknown or already finished ids are ignored (the request may have finished by length).
        """
        if not status.is_finished:
            raise ValueError(f"finish_request needs a FINISHED_* status, got {status}")
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, status)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- one step ---------------------------------------------------------------------------

    def schedule(self) -> ScheduledBatch:
        """Pick this step's requests and token counts, reserving their blocks."""
        # NOTE: one token budget per step, no prefill/decode phases. Running requests go first,
        # in policy order: each takes min(its remaining tokens, the budget) — 1 for a decode, a
        # chunk for an unfinished prefill — plus the blocks for them; when blocks run out, the
        # lowest-priority running request (the list's tail, possibly the request itself) is
        # preempted by recompute. Then, only if nothing was preempted (admitting now would just
        # thrash), waiting requests are admitted in policy order while budget, seats and blocks
        # last, each reusing its longest cached prefix; the last one that does not fit the
        # budget is chunked. Admission stops at the first request that cannot go (no skipping).
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        budget = self._schedule_running(self.config.max_num_batched_tokens, scheduled, preempted)
        if not preempted:
            self._schedule_waiting(budget, scheduled)
        decodes, prefills, num_batched_tokens = [], [], 0
        for item in scheduled:
            (decodes if item.is_decode else prefills).append(item)
            num_batched_tokens += item.num_new_tokens
        return ScheduledBatch(
            requests=decodes + prefills,
            num_decodes=len(decodes),
            num_batched_tokens=num_batched_tokens,
            preempted=preempted,
        )

    def _schedule_running(self, budget: int, scheduled: list[ScheduledRequest],
                          preempted: list[Request]) -> int:
        """Schedule running requests in order; returns the budget left."""
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            # >= 1: update() always leaves a running request at least one token to compute
            num_new_tokens = self._whole_images(request, request.num_computed_tokens,
                                                min(request.num_tokens - request.num_computed_tokens,
                                                    self._chunk_limit(budget)))
            if num_new_tokens == 0:  # its next image does not fit the budget left: next step
                index += 1
                continue
            is_last_chunk = request.num_computed_tokens + num_new_tokens == request.num_tokens
            drafts = request.spec_token_ids[: budget - num_new_tokens] if is_last_chunk else []
            if not self._reserve_blocks(request, num_new_tokens + len(drafts), preempted):
                break  # preempted itself: it was the tail, nothing runs after it
            scheduled.append(ScheduledRequest(request, num_new_tokens + len(drafts), is_last_chunk, drafts))
            num_new_tokens += len(drafts)
            budget -= num_new_tokens
            index += 1
        return budget

    def _reserve_blocks(self, request: Request, num_new_tokens: int,
                        preempted: list[Request]) -> bool:
        """Give a running request the blocks for its next tokens, preempting from the tail."""
        num_needed = self._num_blocks_to_cover(request.num_computed_tokens + num_new_tokens)
        num_needed -= len(request.block_ids)
        if num_needed <= 0:  # most decode steps: the last block has room
            return True
        while not self.block_pool.can_allocate(num_needed):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is request:
                return False
        request.block_ids.extend(block.block_id for block in self.block_pool.allocate(num_needed))
        return True

    def _schedule_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> None:
        """Admit waiting requests in policy order while budget, seats and blocks last."""
        loras: set[int] | None = None  # the running requests' LoRA adapters, gathered once one is asked about
        skipped: list[Request] = []  # waiting for a LoRA slot: the requests behind them go on (vLLM v1's rule)
        while self.waiting and budget > 0 and self._num_seats_taken() < self.config.max_num_seqs:
            request = self.waiting.peek()
            if request.lora_int_id is not None:
                if loras is None:
                    loras = {r.lora_int_id for r in self.running if r.lora_int_id is not None}
                if request.lora_int_id not in loras and len(loras) >= self.config.max_loras:
                    skipped.append(self.waiting.pop())
                    continue
            cached_blocks = self._find_cached_prefix(request)
            num_cached_tokens = len(cached_blocks) * self.block_size
            num_new_tokens = request.num_tokens - num_cached_tokens
            limit = self._chunk_limit(budget)
            if num_new_tokens > limit:
                if not self.config.enable_chunked_prefill:
                    break
                num_new_tokens = self._whole_images(request, num_cached_tokens, limit)
                if num_new_tokens == 0:  # its next image does not fit the budget left
                    break
            num_needed = self._num_blocks_to_cover(num_cached_tokens + num_new_tokens)
            num_needed -= len(cached_blocks)
            if not self.block_pool.can_allocate(num_needed, cached_blocks):
                break
            self.waiting.pop()
            self._admit(request, cached_blocks, num_needed)
            if loras is not None and request.lora_int_id is not None:
                loras.add(request.lora_int_id)
            is_last_chunk = num_cached_tokens + num_new_tokens == request.num_tokens
            scheduled.append(ScheduledRequest(request, num_new_tokens, is_last_chunk))
            budget -= num_new_tokens
        for request in reversed(skipped):  # back in their places
            self.waiting.push_front(request)

    def _chunk_limit(self, budget: int) -> int:
        """The most tokens one request may compute this step: the budget left, capped as config.max_chunk_tokens."""
        return min(budget, self.config.max_chunk_tokens)

    @staticmethod
    def _whole_images(request: Request, start: int, num_new_tokens: int) -> int:
        """num_new_tokens cut so that the chunk from `start` ends inside no image that must stay whole (Gemma 3's,
        attended both ways: runtime/multimodal.ImageInputs.chunk_end); 0 when the chunk would hold no token before
        such an image. A chunk may start inside one (a prefix-cache hit there: its KV was computed whole)."""
        images = request.images
        if images is None or not images.spans:
            return num_new_tokens
        return images.chunk_end(start, start + num_new_tokens) - start

    def _num_seats_taken(self) -> int:
        """Sequences holding a seat (and a persistent-batch row): the running ones here."""
        return len(self.running)

    def _find_cached_prefix(self, request: Request) -> list[KVBlock]:
        """The longest cached prefix, leaving at least the last token to compute (for logits)."""
        if not self.config.enable_prefix_caching or request.skip_prefix_cache:
            return []
        num_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_block_hashes(request, num_blocks)
        blocks = self.block_pool.find_cached_blocks(request.block_hashes[:num_blocks])
        return blocks[:-1] if self.config.recompute_last_cached_block else blocks

    def _admit(self, request: Request, cached_blocks: list[KVBlock], num_new_blocks: int) -> None:
        self.block_pool.share(cached_blocks)
        new_blocks = self.block_pool.allocate(num_new_blocks)
        request.block_ids = [block.block_id for block in cached_blocks + new_blocks]
        num_cached_tokens = len(cached_blocks) * self.block_size
        request.num_computed_tokens = num_cached_tokens
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_cached_tokens
        if self.config.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_cached_tokens
        self._num_hashed_blocks[request.request_id] = len(cached_blocks)
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=self._policy_key)

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks and queue it for a full re-prefill (recompute)."""
        self._free_blocks(request)
        request.spec_token_ids = []
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(request)
        logger.warning(
            "Preempted request %r: the KV cache is full (%d preemptions so far); its KV will be "
            "recomputed. To avoid this, give the KV cache more room (gpu_memory_utilization, cpu_kv_cache_gib on a "
            "CPU, or num_kv_blocks), lower max_num_seqs or max_num_batched_tokens, or raise tensor_parallel_size.",
            request.request_id, self.num_preemptions,
        )

    # ---- after the forward ------------------------------------------------------------------

    def update(self, batch: ScheduledBatch, sampled: dict[str, list[int]]) -> list[Request]:
        """Record a step's results; returns the requests that finished by length (blocks freed).

        `sampled` maps the id of every request scheduled with is_last_chunk to its new tokens
        (one, or several under speculative decoding). Requests finished or aborted since
        `schedule` are skipped.
        """
        live = [item for item in batch.requests if item.request.status is RequestStatus.RUNNING]
        missing = [item.request.request_id for item in live
                   if item.is_last_chunk and not sampled.get(item.request.request_id)]
        if missing:
            raise ValueError(f"update: no sampled tokens for requests {missing}")
        finished: list[Request] = []
        for item in live:
            request = item.request
            request.spec_token_ids = []
            num_rejected, is_at_limit = 0, False
            if item.is_last_chunk:
                tokens = sampled[request.request_id]
                # Under speculation the emitted tokens are the accepted drafts plus one; the KV of
                # the rejected drafts is not the request's and is overwritten later.
                num_rejected = len(item.draft_token_ids) - (len(tokens) - 1) if item.draft_token_ids else 0
                is_at_limit = self._append_tokens(request, tokens)
            # Tokens first, then hashes: a hashed block's tokens must all be in the request.
            request.num_computed_tokens = min(request.num_computed_tokens + item.num_new_tokens - num_rejected,
                                              request.num_tokens)
            self._cache_full_blocks(request)
            if is_at_limit:
                self._finish(request, RequestStatus.FINISHED_LENGTH)
                finished.append(request)
            elif item.draft_token_ids:
                self._trim_blocks(request)
        return finished

    def advance(self, batch: ScheduledBatch) -> list[Request]:
        """Record a step whose sampled tokens are still on the device (overlapped scheduling).

        Like `update`, but each request scheduled with is_last_chunk gains one *pending* token
        (`Request.num_pending_tokens`; no drafts allowed): its computed tokens advance now, so the
        next `schedule` can give it its next position before the value is known. `resolve` appends
        the values later. Returns the requests that reached a length limit (finished, blocks
        freed): their last token is still pending then.
        """
        finished: list[Request] = []
        for item in batch.requests:
            request = item.request
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted or finished since schedule
            if item.draft_token_ids:
                raise ValueError("advance: steps with draft tokens go through update()")
            request.num_computed_tokens += item.num_new_tokens
            self._cache_full_blocks(request)  # the blocks whose tokens are all known
            if not item.is_last_chunk:
                continue
            request.num_pending_tokens += 1
            if (request.num_output_tokens >= request.max_tokens
                    or request.num_tokens >= self.config.max_model_len):
                self._finish(request, RequestStatus.FINISHED_LENGTH)
                finished.append(request)
        return finished

    def complete_prompts(self, batch: ScheduledBatch) -> list[Request]:
        """Record a step of pooling requests (`Request.pooling`: prompts computed, nothing sampled); returns
        those whose last chunk it ran, finished (stopped) with their blocks freed, the full ones left in
        the prefix cache."""
        done: list[Request] = []
        for item in batch.requests:
            request = item.request
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted since schedule
            request.num_computed_tokens += item.num_new_tokens
            self._cache_full_blocks(request)
            if item.is_last_chunk:
                self._finish(request, RequestStatus.FINISHED_STOPPED)
                done.append(request)
        return done

    def resolve(self, request: Request, token_ids: list[int]) -> None:
        """The values of a request's oldest pending tokens arrived: append them, and register the
        blocks they complete in the prefix cache (if the request still runs)."""
        if len(token_ids) > request.num_pending_tokens:
            raise ValueError(f"resolve: {len(token_ids)} tokens for {request.num_pending_tokens} pending")
        request.num_pending_tokens -= len(token_ids)
        request.output_token_ids.extend(token_ids)
        if request.status is RequestStatus.RUNNING:
            self._cache_full_blocks(request)

    def _trim_blocks(self, request: Request) -> None:
        """Return the blocks that held only rejected drafts."""
        num_needed = self._num_blocks_to_cover(request.num_tokens)
        if len(request.block_ids) > num_needed:
            self.block_pool.free(self.block_pool.get_blocks(request.block_ids[num_needed:]))
            # a new list, not a cut of the old one: a changed list is how a block-table mirror
            # (runtime/step_inputs.py) knows that entries it wrote may have been replaced
            request.block_ids = request.block_ids[:num_needed]

    def _append_tokens(self, request: Request, token_ids: list[int]) -> bool:
        """Append sampled tokens up to the length limits; True if the request reached one."""
        for token_id in token_ids:
            request.output_token_ids.append(token_id)
            if (request.num_output_tokens >= request.max_tokens
                    or request.num_tokens >= self.config.max_model_len):
                return True
        return False

    def _cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly full, computed blocks in the prefix cache."""
        if not self.config.enable_prefix_caching:
            return
        # only blocks whose tokens are all known: a pending token's value is not hashable yet
        num_full_blocks = min(request.num_computed_tokens, request.num_known_tokens) // self.block_size
        num_hashed = self._num_hashed_blocks.get(request.request_id, 0)
        if num_full_blocks <= num_hashed:
            return
        self._extend_block_hashes(request, num_full_blocks)
        for index in range(num_hashed, num_full_blocks):
            block = self.block_pool.blocks[request.block_ids[index]]
            self.block_pool.cache_block(block, request.block_hashes[index])
        self._num_hashed_blocks[request.request_id] = num_full_blocks

    def _extend_block_hashes(self, request: Request, num_blocks: int) -> None:
        """Make request.block_hashes cover its first `num_blocks` (full) blocks."""
        hashes = request.block_hashes
        while len(hashes) < num_blocks:
            start = len(hashes) * self.block_size
            token_ids = request.get_token_ids(start, start + self.block_size)
            root = hashes[-1] if hashes else sequence_root_hash(request.lora_int_id, request.image_hash, request.cache_salt)
            hashes.append(hash_block_tokens(root, token_ids))

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._free_blocks(request)
        request.status = status
        del self.requests[request.request_id]
        del self._arrival_index[request.request_id]

    def _free_blocks(self, request: Request) -> None:
        self.block_pool.free(self.block_pool.get_blocks(request.block_ids))
        request.block_ids = []
        self._num_hashed_blocks.pop(request.request_id, None)

    # ---- helpers, stats, checks -------------------------------------------------------------

    def _policy_key(self, request: Request) -> tuple:
        arrival = (request.arrival_time, self._arrival_index[request.request_id])
        if self.config.policy == "priority":
            return (request.priority, *arrival)
        return arrival

    def _num_blocks_to_cover(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def stats(self) -> dict[str, float | int]:
        """Counters for metrics. kv_cache_usage counts free cached blocks as free."""
        return {
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "num_preemptions": self.num_preemptions,
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "kv_cache_usage": self.block_pool.usage,
            "num_free_blocks": self.block_pool.num_free_blocks,
            "num_total_blocks": self.block_pool.num_blocks,
        }

    def check_invariants(self) -> None:
        """Raise AssertionError if requests and blocks disagree (tests call it every step).

        Holds between any two calls: ref counts equal block-table owners, waiting requests own
        nothing, running tables cover their computed tokens; with no unfinished request, this
        means every block is free.
        """
        self.block_pool.check_invariants()
        owners = [0] * self.config.num_blocks
        for request in self.running:
            num_blocks = len(request.block_ids)
            check_invariant(
                request.status is RequestStatus.RUNNING
                and self._num_blocks_to_cover(request.num_computed_tokens) <= num_blocks
                and num_blocks <= self._num_blocks_to_cover(request.num_tokens),
                f"running {request}: block table does not match its computed tokens")
            for block_id in request.block_ids:
                owners[block_id] += 1
        for request in self.waiting:
            check_invariant(request.status is RequestStatus.WAITING and not request.block_ids
                            and request.num_computed_tokens == 0, f"waiting {request} holds KV")
        check_invariant(owners == [block.ref_count for block in self.block_pool.blocks],
                        "a block's ref count differs from the number of block tables holding it")
        check_invariant(len(self.running) <= self.config.max_num_seqs, "above max_num_seqs")
        check_invariant(len(self.running) + len(self.waiting) == len(self.requests), "lost one")
        check_invariant(self.running == sorted(self.running, key=self._policy_key), "unsorted")
