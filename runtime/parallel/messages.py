"""The step message: what the driver sends every rank for one forward pass, and how.

NOTE (protocol): a message is two int64 broadcasts from rank 0 on the control group (gloo, CPU):

  header   [HEADER_SIZE]: kind, num_tokens, num_seqs, max_num_blocks, num_logits
  payload  [3 * num_tokens + 2 * num_seqs + num_logits + num_seqs * max_num_blocks]:
           input_ids, positions, slot_mapping (num_tokens each), context_lens, query_lens
           (num_seqs each), logits_indices (num_logits), block_tables (row-major)

SHUTDOWN has no payload. Plain integers only: no pickles, no method names; a worker decodes the
message into the same ForwardBatch the single-rank runner builds, so the scheduler's block tables
are shared by every rank while each rank's KV cache holds only its heads of its layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch
from torch import Tensor

from llmc.runtime.forward_batch import ForwardBatch

HEADER_SIZE = 5


class StepKind(IntEnum):
    FORWARD = 1  # run the model on the batch; last-stage ranks send their logits to the driver
    SHUTDOWN = 2  # leave the worker loop, destroy the groups, exit


@dataclass
class StepMessage:
    """One step, as every rank receives it (CPU tensors)."""

    kind: StepKind
    input_ids: Tensor  # [num_tokens] int64
    positions: Tensor  # [num_tokens] int64
    slot_mapping: Tensor  # [num_tokens] int64 KV-cache slot of each token
    context_lens: list[int]  # [num_seqs] tokens in the cache after this step
    query_lens: list[int]  # [num_seqs] tokens computed this step
    logits_indices: Tensor  # [num_logits] int64 flat token indices whose logits the driver needs
    block_tables: Tensor  # [num_seqs, max_num_blocks] int32

    @classmethod
    def forward(cls, input_ids: Tensor, batch: ForwardBatch) -> StepMessage:
        return cls(StepKind.FORWARD, input_ids.cpu(), batch.positions.cpu(), batch.slot_mapping.cpu(),
                   batch.context_lens.tolist(), list(batch.query_lens), batch.logits_indices.cpu(),
                   batch.block_tables.cpu())

    @classmethod
    def shutdown(cls) -> StepMessage:
        empty = torch.empty(0, dtype=torch.long)
        return cls(StepKind.SHUTDOWN, empty, empty, empty, [], [], empty, torch.empty(0, 0, dtype=torch.int32))

    @property
    def num_logits(self) -> int:
        return self.logits_indices.shape[0]

    def to_device(self, device: torch.device) -> tuple[Tensor, ForwardBatch]:
        """(input_ids, ForwardBatch) on the rank's device."""
        batch = ForwardBatch(
            positions=self.positions.to(device),
            slot_mapping=self.slot_mapping.to(device),
            block_tables=self.block_tables.to(device),
            context_lens=torch.tensor(self.context_lens, dtype=torch.int32, device=device),
            query_lens=self.query_lens,
            max_context_len=max(self.context_lens, default=0),
            logits_indices=self.logits_indices.to(device),
        )
        return self.input_ids.to(device), batch

    def encode(self) -> tuple[Tensor, Tensor]:
        """(header [HEADER_SIZE], payload) int64."""
        num_seqs, max_num_blocks = self.block_tables.shape
        header = torch.tensor([int(self.kind), self.input_ids.shape[0], num_seqs, max_num_blocks, self.num_logits])
        payload = torch.cat([
            self.input_ids, self.positions, self.slot_mapping,
            torch.tensor(self.context_lens + self.query_lens, dtype=torch.long),
            self.logits_indices, self.block_tables.to(torch.long).flatten(),
        ])
        return header, payload

    @classmethod
    def decode(cls, header: Tensor, payload: Tensor) -> StepMessage:
        kind, num_tokens, num_seqs, max_num_blocks, num_logits = header.tolist()
        sizes = [num_tokens, num_tokens, num_tokens, num_seqs, num_seqs, num_logits, num_seqs * max_num_blocks]
        input_ids, positions, slots, context_lens, query_lens, logits_indices, tables = payload.split(sizes)
        return cls(StepKind(kind), input_ids, positions, slots, context_lens.tolist(), query_lens.tolist(),
                   logits_indices, tables.view(num_seqs, max_num_blocks).to(torch.int32))


def send_step(groups, message: StepMessage) -> None:
    """Driver: broadcast one message to every rank."""
    header, payload = message.encode()
    groups.broadcast(header)
    if payload.numel():
        groups.broadcast(payload)


def receive_step(groups) -> StepMessage:
    """Worker: wait for the driver's next message."""
    header = groups.broadcast(torch.zeros(HEADER_SIZE, dtype=torch.long))
    kind, num_tokens, num_seqs, max_num_blocks, num_logits = header.tolist()
    size = 3 * num_tokens + 2 * num_seqs + num_logits + num_seqs * max_num_blocks
    payload = groups.broadcast(torch.zeros(size, dtype=torch.long)) if size else torch.zeros(0, dtype=torch.long)
    return StepMessage.decode(header, payload)
