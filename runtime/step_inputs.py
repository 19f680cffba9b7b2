"""Persistent step buffers: a step's inputs built in preallocated host memory, sent in one copy.

NOTE (persistent buffers): the block table of every persistent-batch row (`Request.batch_row`)
lives in a host array that is updated incrementally: a request's new blocks are written as they
appear, and the row is rewritten only when the request's block list was replaced (admission,
re-admission after preemption). Each step packs its token ids, positions, KV slots, logits row
indices, context lengths, sampling rows, placeholder fix-ups and block-table rows into one int64
staging buffer (pinned on a GPU) and sends it to the device in one non-blocking copy; the
ForwardBatch's tensors are views of it. Two staging buffers alternate, so the host can fill step
N+1's while step N's copy may still be in flight (the engine resolves step N before it builds step
N+2).

NOTE (placeholders): under overlapped scheduling a decode row's input token may be a token the
previous step sampled whose value has not reached the host (`Request.num_pending_tokens`). Its
slot in input_ids is filled on the device from the previous step's sampled-token tensor
(`PendingTokens`), so step N+1 can be launched before step N's tokens are known.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from llmc.runtime.batch_sampler import HostTokens, SampledStep
from llmc.runtime.forward_batch import ForwardBatch
from llmc.runtime.request import Request
from llmc.runtime.scheduler import ScheduledBatch
from torch import Tensor


@dataclass
class PendingTokens:
    """The previous step's sampled tokens, still on the device.

    Fields:
        token_ids: [num_sampled] int64 device tensor, one token per sampled request of that step.
        index: request_id -> its entry in token_ids.
    """

    token_ids: Tensor
    index: dict[str, int]


@dataclass
class InFlight:
    """A launched step: its sampled tokens (on the device, and on their way to the host).

    Fields:
        sampled: the sampler's device tensors.
        host: the tokens' (and logprobs') copy to the host.
        requests: the sampled requests, in the order of the sampled tokens.
        index: request_id -> position in `requests` (for the next step's placeholders).
        prompt_logits: request_id -> (first position, logits rows) for prompt logprobs.
        num_prefill: prompt tokens the step computed (statistics).
    """

    sampled: SampledStep
    host: HostTokens
    requests: list[Request]
    index: dict[str, int]
    prompt_logits: dict[str, tuple[int, Tensor]]
    num_prefill: int


@dataclass
class StepInputs:
    """One step's model inputs on the device (views of the copied staging buffer).

    Fields:
        input_ids: [num_tokens] int64.
        forward_batch: positions, slots, block tables, lengths, logits rows of the step.
        sample_rows: [num_sampled] int64 persistent-batch row of each sampled request, in logits order.
        prompt_spans: request_id -> (first position, number of rows) of prompt-logprob logits rows,
            which follow the sampling rows (one per sampled request plus one per draft token).
        num_sampling_rows: logits rows that sample a token (before the prompt-logprob rows).
        pending_dst, pending_src: [num_fixups] int64, the placeholders' indices in input_ids and in
            the previous step's sampled tokens (already filled in, unless the buffers defer them).
    """

    input_ids: Tensor
    forward_batch: ForwardBatch
    sample_rows: Tensor
    prompt_spans: dict[str, tuple[int, int]]
    num_sampling_rows: int
    pending_dst: Tensor | None = None
    pending_src: Tensor | None = None


class StepBuffers:
    """Host block tables per persistent row and the staging buffers of the step's single copy."""

    def __init__(self, num_rows: int, max_num_tokens: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, defer_pending: bool = False):
        """defer_pending: leave placeholders 0 (the parallel driver: its ranks fill them in)."""
        self.block_size, self.device, self.defer_pending = block_size, device, defer_pending
        self.block_tables = np.zeros((num_rows, max_blocks_per_seq), dtype=np.int64)  # host, per row
        self._num_written = [0] * num_rows  # entries of each row's table already written
        self._owner_lists: list[list[int] | None] = [None] * num_rows  # the block list a row mirrors
        # token arrays (ids, positions, slots, logits rows: drafts and prompt rows are <= tokens),
        # per-sequence arrays (context lens, sample rows, fix-up pairs) and the block tables
        capacity = 4 * max_num_tokens + 4 * num_rows + num_rows * max_blocks_per_seq
        pin = device.type == "cuda"
        self._staging = [torch.zeros(capacity, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._device_buffer = torch.zeros(capacity, dtype=torch.int64, device=device) if pin else None
        self._num_steps = 0

    def _sync_table(self, request) -> int:
        """Bring the request's row of the host block table up to date; returns its row."""
        row, blocks = request.batch_row, request.block_ids
        if self._owner_lists[row] is not blocks:  # a new block list: rewrite the row
            self._owner_lists[row], self._num_written[row] = blocks, 0
        written = self._num_written[row]
        if len(blocks) > written:
            self.block_tables[row, written : len(blocks)] = blocks[written:]
        self._num_written[row] = len(blocks)  # the scheduler only appends to a list it keeps
        return row

    def build(self, batch: ScheduledBatch, pending: PendingTokens | None = None) -> StepInputs:
        """Pack the scheduled chunks into the staging buffer, copy once, and return device views."""
        if is_single_token_step(batch):
            return self._build_single_tokens(batch, pending)
        return self._build_chunks(batch, pending)

    def _build_chunks(self, batch: ScheduledBatch, pending: PendingTokens | None) -> StepInputs:
        """Any step: prefill chunks, drafts, prompt-logprob rows, decodes."""
        # NOTE: one Python pass over the scheduled requests gathers per-sequence values and token
        # ids; positions, slots and table rows are then numpy operations over the whole step.
        token_ids: list[int] = []
        starts, num_news, rows, sample_ends, prompt_spans, fixups = [], [], [], [], {}, []
        sample_rows, prompt_indices = [], []
        for scheduled in batch.requests:
            request = scheduled.request
            start, num_new, drafts = request.num_computed_tokens, scheduled.num_new_tokens, scheduled.draft_token_ids
            offset = len(token_ids)
            num_real = num_new - len(drafts)
            if request.num_pending_tokens and start + num_real > request.num_known_tokens:
                # the last token is still on the device: a placeholder, filled from the previous step
                token_ids.extend(request.get_token_ids(start, request.num_known_tokens))
                fixups.append((len(token_ids), pending.index[request.request_id]))
                token_ids.append(0)
            else:
                token_ids.extend(request.get_token_ids(start, start + num_real))
            token_ids.extend(drafts)
            rows.append(self._sync_table(request))
            starts.append(start)
            num_news.append(num_new)
            if scheduled.is_last_chunk:  # the last real token, then each draft: one row each
                sample_ends.append((offset + num_real - 1, len(drafts)))
                sample_rows.append(request.batch_row)
            if request.skip_prefix_cache:  # prompt logprobs: positions whose next token is in the prompt
                end = min(start + num_new, request.num_prompt_tokens - 1)
                if end > start:
                    prompt_spans[request.request_id] = (start, end - start)
                    prompt_indices.extend(range(offset, offset + end - start))
        starts_np, num_news_np, rows_np = np.array(starts), np.array(num_news), np.array(rows)
        seq_offsets = np.cumsum(num_news_np) - num_news_np
        seq_of_token = np.repeat(np.arange(len(rows)), num_news_np)
        positions = np.arange(len(token_ids)) - seq_offsets[seq_of_token] + starts_np[seq_of_token]
        slots = (self.block_tables[rows_np[seq_of_token], positions // self.block_size] * self.block_size
                 + positions % self.block_size)
        logits_rows = [i for end, num_drafts in sample_ends for i in range(end, end + 1 + num_drafts)] + prompt_indices
        return self._pack(_Gathered(token_ids, positions, slots, starts_np + num_news_np, num_news, rows, logits_rows,
                                    len(logits_rows) - len(prompt_indices), sample_rows, prompt_spans, fixups), pending)

    def _build_single_tokens(self, batch: ScheduledBatch, pending: PendingTokens | None) -> StepInputs:
        """A step of one token per sequence (decodes), gathered in one Python pass: at the batch
        sizes where host time shows (a few sequences) this beats numpy's per-call cost. A request with M-RoPE
        images (Qwen2-VL) rotates at its index + rope_delta (runtime/mrope.py; its slot stays the index's)."""
        token_ids, positions, slots, rows, logits_rows, sample_rows, fixups = [], [], [], [], [], [], []
        context_lens = []
        block_size = self.block_size
        for i, scheduled in enumerate(batch.requests):
            request = scheduled.request
            position = request.num_computed_tokens
            if request.num_pending_tokens and position >= request.num_known_tokens:
                fixups.append((i, pending.index[request.request_id]))  # a placeholder (see build)
                token_ids.append(0)
            else:
                token_ids.append(request.get_token_ids(position, position + 1)[0])
            rows.append(self._sync_table(request))
            positions.append(position if request.images is None else position + request.images.rope_delta)
            context_lens.append(position + 1)
            slots.append(request.block_ids[position // block_size] * block_size + position % block_size)
            if scheduled.is_last_chunk:
                logits_rows.append(i)
                sample_rows.append(request.batch_row)
        return self._pack(_Gathered(token_ids, positions, slots, context_lens, [1] * len(rows), rows, logits_rows,
                                    len(logits_rows), sample_rows, {}, fixups), pending)

    def _pack(self, g: _Gathered, pending: PendingTokens | None) -> StepInputs:
        num_seqs = len(g.rows)
        width = max(self._num_written[row] for row in g.rows)
        parts = [g.token_ids, g.positions, g.slots, g.logits_rows, g.context_lens, g.sample_rows,
                 [dst for dst, _ in g.fixups], [src for _, src in g.fixups],
                 self.block_tables[g.rows, :width].ravel()]
        staging = self._staging[self._num_steps % 2]
        self._num_steps += 1
        host = staging.numpy()
        bounds, at = [], 0
        for part in parts:
            host[at : at + len(part)] = part
            bounds.append((at, at + len(part)))
            at += len(part)
        if self._device_buffer is not None:
            device = self._device_buffer[:at]
            device.copy_(staging[:at], non_blocking=True)
        else:  # a CPU step has finished reading its buffer when execute returns; the two alternate anyway
            device = staging[:at]
            if g.fixups and not self.defer_pending:  # the previous step's tokens are computed: fill in on the host
                sampled = pending.token_ids.numpy()
                for dst, src in g.fixups:
                    host[dst] = sampled[src]
        views = [device[a:b] for a, b in bounds]
        input_ids = views[0]
        if g.fixups and self._device_buffer is not None and not self.defer_pending:
            input_ids[views[6]] = pending.token_ids[views[7]]
        forward_batch = ForwardBatch(
            positions=views[1],
            slot_mapping=views[2],
            block_tables=views[8].view(num_seqs, width).to(torch.int32),
            context_lens=views[4].to(torch.int32),
            query_lens=g.num_news,
            max_context_len=int(np.max(g.context_lens) if isinstance(g.context_lens, np.ndarray) else max(g.context_lens)),
            logits_indices=views[3],
            host_context_lens=g.context_lens,
        )
        return StepInputs(input_ids, forward_batch, views[5], g.prompt_spans, g.num_sampling_rows, views[6], views[7])


def is_single_token_step(batch: ScheduledBatch) -> bool:
    """Whether StepBuffers builds the step by its single-token path: each sequence one token, without drafts or
    prompt logprobs."""
    return all(s.num_new_tokens == 1 and not s.draft_token_ids and not s.request.skip_prefix_cache
               for s in batch.requests)


@dataclass
class _Gathered:
    """A step's inputs gathered on the host (lists or numpy arrays), before packing.

    Fields: per token: token_ids, positions, slots; per sequence: context_lens, num_news (query
    lengths), rows (persistent-batch rows); logits_rows (flat token indices: sampling rows, then
    prompt-logprob rows), num_sampling_rows, sample_rows (the row of each sampled sequence),
    prompt_spans (see StepInputs), fixups ((index in token_ids, index in the pending tokens)).
    """

    token_ids: list[int]
    positions: list[int] | np.ndarray
    slots: list[int] | np.ndarray
    context_lens: list[int] | np.ndarray
    num_news: list[int]
    rows: list[int]
    logits_rows: list[int]
    num_sampling_rows: int
    sample_rows: list[int]
    prompt_spans: dict[str, tuple[int, int]]
    fixups: list[tuple[int, int]]
