"""The step message: what the driver sends every rank for one forward pass, and how.

NOTE (protocol): a message is two int64 broadcasts from rank 0 on the control group (gloo, CPU):

  header   [HEADER_SIZE]: kind, num_tokens, num_seqs, max_num_blocks, num_logits, num_fixups, num_pending
  payload  [3 * num_tokens + 2 * num_seqs + num_logits + 2 * num_fixups + num_seqs * max_num_blocks]:
           input_ids, positions, slot_mapping (num_tokens each), context_lens, query_lens
           (num_seqs each), logits_indices (num_logits), fixup_dst, fixup_src (num_fixups each),
           block_tables (row-major)

SHUTDOWN has no payload. Plain integers only: no pickles, no method names; a rank decodes the
message into the same ForwardBatch the single-rank runner builds, so the scheduler's block tables
are shared by every rank while each rank's KV cache holds only its heads of its layers.

NOTE (placeholders): under overlapped scheduling the driver sends step N+1 before step N's sampled
tokens reach its host. A decode row whose input token is one of them carries a placeholder (0) in
input_ids and a fix-up pair (dst: its index in input_ids, src: its index in step N's sampled
tokens). The first stage resolves them on its device, as the single-rank runner does
(runtime/step_inputs.py): the driver broadcasts step N's sampled-token tensor (num_pending int64,
on the device) over the first stage's tensor-parallel group, and every first-stage rank writes
input_ids[dst] = sampled[src] before embedding. No host ever waits for the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch
from torch import Tensor

from llmc.runtime.forward_batch import ForwardBatch

HEADER_SIZE = 7


class StepKind(IntEnum):
    FORWARD = 1  # run the model on the batch; last-stage ranks send their logits to the driver
    SHUTDOWN = 2  # leave the worker loop, destroy the groups, exit


@dataclass
class RankStep:
    """A step's inputs on a rank's device (views of one copied payload).

    Fields:
        input_ids: [num_tokens] int64, placeholders still 0 (see fixup_dst).
        batch: the ForwardBatch of the step.
        fixup_dst: [num_fixups] int64 indices in input_ids of placeholders.
        fixup_src: [num_fixups] int64 indices in the previous step's sampled tokens.
        num_pending: how many tokens the previous step sampled (0: no placeholder this step).
    """

    input_ids: Tensor
    batch: ForwardBatch
    fixup_dst: Tensor
    fixup_src: Tensor
    num_pending: int


@dataclass
class StepMessage:
    """One step, as every rank receives it: the header's sizes and the flat int64 CPU payload."""

    kind: StepKind
    num_tokens: int
    num_seqs: int
    max_num_blocks: int
    num_logits: int
    num_fixups: int
    num_pending: int
    payload: Tensor  # [payload_size(...)] int64, CPU

    @classmethod
    def forward(cls, input_ids: Tensor, batch: ForwardBatch, fixups: tuple[Tensor, Tensor] | None = None,
                num_pending: int = 0) -> StepMessage:
        """`fixups`: (dst, src) of the step's placeholders; num_pending: the previous step's sampled tokens."""
        empty = torch.empty(0, dtype=torch.long)
        dst, src = fixups if fixups is not None else (empty, empty)
        num_seqs, max_num_blocks = batch.block_tables.shape
        payload = torch.cat([
            input_ids.cpu(), batch.positions.cpu(), batch.slot_mapping.cpu(),
            batch.context_lens.cpu().to(torch.long), torch.tensor(batch.query_lens, dtype=torch.long),
            batch.logits_indices.cpu(), dst.cpu(), src.cpu(), batch.block_tables.cpu().to(torch.long).flatten(),
        ])
        return cls(StepKind.FORWARD, input_ids.shape[0], num_seqs, max_num_blocks, batch.logits_indices.shape[0],
                   dst.shape[0], num_pending if dst.shape[0] else 0, payload)

    @classmethod
    def shutdown(cls) -> StepMessage:
        return cls(StepKind.SHUTDOWN, 0, 0, 0, 0, 0, 0, torch.empty(0, dtype=torch.long))

    def _sizes(self) -> list[int]:
        t, s, f = self.num_tokens, self.num_seqs, self.num_fixups
        return [t, t, t, s, s, self.num_logits, f, f, s * self.max_num_blocks]

    def host_lens(self) -> tuple[list[int], list[int]]:
        """(context_lens, query_lens) as host lists."""
        sections = self.payload.split(self._sizes())
        return sections[3].tolist(), sections[4].tolist()

    def to_device(self, device: torch.device) -> RankStep:
        """The step on the rank's device: one (non-blocking, on a GPU) copy of the payload."""
        context_lens, query_lens = self.host_lens()
        if device.type == "cuda":
            on_device = self.payload.pin_memory().to(device, non_blocking=True)
        else:
            on_device = self.payload
        ids, positions, slots, lens, _, logits_indices, dst, src, tables = on_device.split(self._sizes())
        batch = ForwardBatch(
            positions=positions,
            slot_mapping=slots,
            block_tables=tables.view(self.num_seqs, self.max_num_blocks).to(torch.int32),
            context_lens=lens.to(torch.int32),
            query_lens=query_lens,
            max_context_len=max(context_lens, default=0),
            logits_indices=logits_indices,
            host_context_lens=context_lens,
        )
        return RankStep(ids, batch, dst, src, self.num_pending)

    def header(self) -> Tensor:
        return torch.tensor([int(self.kind), self.num_tokens, self.num_seqs, self.max_num_blocks, self.num_logits,
                             self.num_fixups, self.num_pending], dtype=torch.long)


def payload_size(num_tokens: int, num_seqs: int, max_num_blocks: int, num_logits: int, num_fixups: int) -> int:
    return 3 * num_tokens + 2 * num_seqs + num_logits + 2 * num_fixups + num_seqs * max_num_blocks


def send_step(groups, message: StepMessage) -> None:
    """Driver: broadcast one message to every rank."""
    groups.broadcast(message.header())
    if message.payload.numel():
        groups.broadcast(message.payload)


def receive_step(groups) -> StepMessage:
    """Worker: wait for the driver's next message."""
    header = groups.broadcast(torch.zeros(HEADER_SIZE, dtype=torch.long))
    kind, num_tokens, num_seqs, max_num_blocks, num_logits, num_fixups, num_pending = header.tolist()
    size = payload_size(num_tokens, num_seqs, max_num_blocks, num_logits, num_fixups)
    payload = groups.broadcast(torch.zeros(size, dtype=torch.long)) if size else torch.zeros(0, dtype=torch.long)
    return StepMessage(StepKind(kind), num_tokens, num_seqs, max_num_blocks, num_logits, num_fixups, num_pending,
                       payload)
