"""The runner contract: what the Engine asks of whatever runs the model.

Three implementations: `ModelRunner` (one rank: runtime/model_runner.py), `ParallelModelRunner`
(rank 0 of a tensor/pipeline-parallel engine: runtime/parallel/driver.py) and `OnnxRunner` (an onnx-cpu
artifact through onnxruntime: runtime/onnx_runner.py). The engine owns the
scheduler, the persistent batch rows (`Request.batch_row`) and the sampler; a runner owns the
weights, the KV cache, its step buffers and graphs, and turns a ScheduledBatch into logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from llmc.runtime.scheduler import ScheduledBatch
from llmc.runtime.step_inputs import PendingTokens, StepInputs


@dataclass
class StepLogits:
    """A step's logits, still on the device.

    Fields:
        logits: [num_sampling_rows, vocab_size], the model's dtype (float32 from the parallel and
            ONNX runners): one row per sampled request (its last position), plus one per draft token
            after it, in scheduling order. Whoever changes them works on a float32 copy.
        sample_rows: [num_sampled] int64 device tensor, the persistent-batch row of each sampled request.
        prompt_logits: request_id -> (first position, [n, vocab_size] logits) for prompt logprobs.
    """

    logits: Tensor
    sample_rows: Tensor
    prompt_logits: dict[str, tuple[int, Tensor]]

    @classmethod
    def split(cls, logits: Tensor, inputs: StepInputs) -> StepLogits:
        """Cut the forward's logits rows into sampling rows and each request's prompt rows."""
        prompt_logits, row = {}, inputs.num_sampling_rows
        for request_id, (first_position, num_rows) in inputs.prompt_spans.items():
            prompt_logits[request_id] = (first_position, logits[row : row + num_rows])
            row += num_rows
        return cls(logits[: inputs.num_sampling_rows], inputs.sample_rows, prompt_logits)


class Runner(Protocol):
    """What the engine calls. Fields: `device` (where logits come back), `num_blocks` (KV blocks
    the scheduler may hand out), `can_overlap` (True: `execute` only enqueues device work, so the
    engine may schedule step N+1 before step N's tokens reach the host)."""

    device: torch.device
    num_blocks: int
    can_overlap: bool

    def execute(self, batch: ScheduledBatch, pending: PendingTokens | None = None) -> StepLogits:
        """One step's forward. `pending`: the previous step's sampled tokens on the device (only
        when can_overlap), for decode rows whose input token is not known on the host yet."""
        ...

    def score(self, token_ids: list[int], block_ids: list[int], chunk_size: int) -> Tensor:
        """Logits [len(token_ids), vocab_size] float32 at every position of one sequence."""
        ...

    def close(self) -> None:
        """Release what the runner holds (worker ranks, process groups); idempotent."""
        ...
