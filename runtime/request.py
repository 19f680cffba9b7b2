"""One generation request as the scheduler sees it: token ids, progress and its KV block table.

Plain Python, no tensors. The engine creates a `Request`, the scheduler mutates its progress
fields (`num_computed_tokens`, `block_ids`, `status`, ...) and the engine appends nothing itself:
sampled tokens go through `Scheduler.update`. Also here: the scheduler's `WaitingQueue` and the
up-front `check_request_can_run`.
"""

from __future__ import annotations

import bisect
import enum
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from llmc.errors import RequestError


class RequestStatus(enum.Enum):
    """Where a request is in its life. The FINISHED_* states are terminal."""

    WAITING = enum.auto()           # queued: no blocks, nothing computed (new or preempted)
    RUNNING = enum.auto()           # admitted: owns blocks, is prefilling or decoding
    FINISHED_STOPPED = enum.auto()  # the engine saw a stop condition (eos, stop string, ...)
    FINISHED_LENGTH = enum.auto()   # reached max_tokens or max_model_len
    FINISHED_ABORTED = enum.auto()  # the client went away or the engine aborted it

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED_STATUSES


_FINISHED_STATUSES = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)


@dataclass(eq=False)  # identity equality: a request is an entity, and lists use ==
class Request:
    """A request's tokens and scheduling state (a boundary object between engine and scheduler).

    Fields:
        request_id: unique among unfinished requests of one scheduler.
        prompt_token_ids: the prompt, never modified.
        max_tokens: generation budget; the request finishes by length after this many tokens.
        arrival_time: when the engine received it (any monotonic clock); orders FCFS and ties.
        priority: lower runs first under the "priority" policy; ignored under "fcfs".
        sampling_params: opaque to the scheduler; carried for the engine's sampler.
        output_token_ids: tokens generated so far, in order (kept across preemptions).
        num_computed_tokens: leading tokens of `all_token_ids` whose KV is in the cache.
            Reset to 0 when the request is preempted.
        num_cached_tokens: of the prompt, tokens served from the prefix cache at the first
            schedule (0 until then, and 0 without a hit).
        block_ids: the block table: block i holds the KV of tokens [i*block_size, (i+1)*block_size).
            Only appended to; shortened or rebuilt by assigning a new list.
            Empty while waiting.
        status: see `RequestStatus`.
        num_preemptions: how many times this request was preempted (its KV recomputed).
        spec_token_ids: draft tokens (speculative decoding) to verify in the request's next step;
            set by the engine after a step, cleared on preemption, never part of all_token_ids.
        skip_prefix_cache: never reuse cached blocks for it (prompt logprobs need the logits of
            every prompt position, so every prompt token is computed).
        block_hashes: prefix-cache hashes of the full blocks of `all_token_ids`, a chain
            (hash i covers tokens [0, (i+1)*block_size)). Maintained lazily by the scheduler;
            depends on tokens only, so it survives preemption.
        num_pending_tokens: tokens sampled on the device whose values the host does not know yet
            (overlapped scheduling: `Scheduler.advance` counts them, `Scheduler.resolve` appends
            them to output_token_ids). They count in num_tokens, never in all_token_ids.
        batch_row: the request's row in the engine's persistent batch (sampling state, block table)
            while it runs; None while waiting. Set and cleared by the engine.
        beam_group_id: the beam search this request is a beam of (runtime/beam_scheduler.py), else
            None; a beam's last block may be shared, so it is checked for copy-on-write.
        lora_int_id: the run-time LoRA adapter its tokens go through (runtime/lora.py), else None; part of
            its blocks' prefix-cache hashes (another adapter's KV is another KV).
        pooling: an embedding request (runtime/pooling.py): its prompt is computed and nothing is sampled
            (max_tokens 0); it ends when its last chunk has run (`Scheduler.complete_prompts`).
        images: a vision model's encoded images (runtime/multimodal.ImageInputs: embedding rows on the device, opaque
            to the scheduler but for `image_hash`), else None; kept until it ends, so a recompute puts them in again.
            A prompt given as embeddings holds its rows here too (runtime/prompt_embeds.py).
        prompt_is_embeds: the prompt was given as embeddings: its token ids are placeholders (known_prompt_token_ids).
        cache_salt: vLLM's per-request prefix-cache salt (part of its blocks' hashes), else None.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float
    priority: int = 0
    sampling_params: object = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    skip_prefix_cache: bool = False
    spec_token_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    num_pending_tokens: int = 0
    batch_row: int | None = None
    beam_group_id: str | None = None
    lora_int_id: int | None = None
    pooling: bool = False
    images: object = None
    prompt_is_embeds: bool = False
    cache_salt: str | None = None

    @property
    def known_prompt_token_ids(self) -> list[int]:
        """The prompt's token ids as penalties, logits processors and the detokenizer read them: none for a prompt
        given as embeddings (its ids are placeholders)."""
        return [] if self.prompt_is_embeds else self.prompt_token_ids

    @property
    def image_hash(self) -> bytes | None:
        """The digest of its images (part of its blocks' prefix-cache hashes), None without images."""
        return None if self.images is None else self.images.hash

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, the pending ones (values not yet on the host) included."""
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens (pending ones included): what a full (re-)prefill computes."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_known_tokens(self) -> int:
        """Leading tokens whose values the host knows: num_tokens less the pending ones."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """A new list: prompt followed by output. Use `get_token_ids` for a slice on hot paths."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def get_token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of `all_token_ids` without building the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]


class WaitingQueue:
    """Waiting requests in admission order: a deque for FCFS (`sort_key` None), else a list
    kept sorted by `sort_key` (the priority policy's (priority, arrival) key)."""

    def __init__(self, sort_key: Callable[[Request], tuple] | None):
        self._sort_key = sort_key
        self._requests: deque[Request] | list[Request] = deque() if sort_key is None else []

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def push(self, request: Request) -> None:
        """A new arrival: the tail under FCFS, its (priority, arrival) place otherwise."""
        if self._sort_key is None:
            self._requests.append(request)
        else:
            bisect.insort(self._requests, request, key=self._sort_key)

    def push_front(self, request: Request) -> None:
        """A preempted request: the head under FCFS, its (priority, arrival) place otherwise."""
        if self._sort_key is None:
            self._requests.appendleft(request)
        else:
            bisect.insort(self._requests, request, key=self._sort_key)

    def peek(self) -> Request:
        return self._requests[0]

    def pop(self) -> Request:
        return self._requests.popleft() if self._sort_key is None else self._requests.pop(0)

    def remove(self, request: Request) -> None:
        self._requests.remove(request)


def check_request_can_run(request: Request, max_model_len: int, block_size: int,
                          num_blocks: int) -> None:
    """Raise RequestError for a request that could never finish, whatever the load."""
    name = f"request {request.request_id!r}"
    if request.num_prompt_tokens == 0:
        raise RequestError(f"{name} has an empty prompt; give at least one token")
    if request.max_tokens < (0 if request.pooling else 1):
        raise RequestError(f"{name}: max_tokens must be at least 1, got {request.max_tokens}")
    if request.status is not RequestStatus.WAITING or request.block_ids:
        raise ValueError(f"{name} was already scheduled; add a fresh Request")
    num_total = request.num_prompt_tokens + request.max_tokens
    if num_total > max_model_len:
        raise RequestError(
            f"{name}: prompt ({request.num_prompt_tokens} tokens) + max_tokens "
            f"({request.max_tokens}) = {num_total} exceeds max_model_len ({max_model_len}); "
            "shorten the prompt, lower max_tokens or raise max_model_len"
        )
    # The last sampled token is never fed back, so its KV is never stored (a pooling request samples none).
    num_blocks_needed = -(-(num_total - (0 if request.pooling else 1)) // block_size)
    if num_blocks_needed > num_blocks:
        raise RequestError(
            f"{name} needs up to {num_blocks_needed} KV blocks but the whole cache has "
            f"{num_blocks}; shorten the prompt, lower max_tokens, or raise "
            "gpu_memory_utilization / num_kv_blocks"
        )
