"""CUDA graphs of decode steps: one per planned batch size, captured at start, replayed per step.

A decode step launches a few hundred small kernels; replaying a captured graph launches them all at
once, so the GPU does not wait for Python. A graph replays fixed kernels on fixed addresses: every
input lives in a static buffer, and the host values the kernels were launched with (the number of
rows, the attention's key split) are frozen at capture.

NOTE (capture): after the KV cache is allocated, the graphs are captured largest batch size first,
all in one memory pool, so a smaller graph's intermediates reuse what a larger one left: the pool
holds about one step of the largest size. Each size runs once eagerly first (Triton compiles its
kernels for exactly these launch arguments, cuBLAS sets up its workspace), then is captured with
every row a padding row. The attention is captured with max_context_len = max_model_len, so one
graph serves every context length.

NOTE (padding): a step of n sequences replays the graph of the next size up, b >= n. Rows n..b-1
are padding: they write their K/V to a scratch block (the KV cache's last block, which the
scheduler never hands out) and attend to that one slot (context_len 1, written by the step itself,
so never garbage); they read nothing of a real sequence and write nothing one reads. Their token
ids and positions are whatever an earlier step left there (valid values); their outputs are
dropped.

A hybrid model's decode graphs (Qwen3.5: runtime/models/gated_deltanet.py) read and write its states by the
state_slots buffer: the Gated DeltaNet's decode is device ops on the slots' rows; padding rows use the scratch slot.

Only steps whose every sequence computes one token (ForwardBatch.is_decode: no prefill chunk of
more than one token, no draft tokens) and that fit the largest graph are replayed; other steps replay
the piecewise graphs (runtime/piecewise_graphs.py) or run eagerly. `enforce_eager`, a CPU device, or
no Triton turn graphs off. A tensor/pipeline-parallel rank captures its stage's part of the forward (collectives included) with this same class, in
lockstep with the other ranks (runtime/parallel/shard_runner.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import Tensor

from llmc.kernels import device_num_sms, is_triton_installed
from llmc.kernels.attention import eager_decode_cases
from llmc.runtime import memory
from llmc.runtime.forward_batch import ForwardBatch
from llmc.runtime.models.decoder import DecoderModel

logger = logging.getLogger("llmc")


def can_use_graphs(device: torch.device, enforce_eager: bool) -> bool:
    """Graphs need CUDA and the Triton kernels (the torch fallbacks read context lengths on the host)."""
    return device.type == "cuda" and not enforce_eager and is_triton_installed()


def graph_batch_sizes(planned: list[int], max_num_seqs: int) -> list[int]:
    """The planned batch sizes below max_num_seqs, then max_num_seqs itself, ascending. The plan ends
    with the build's max_num_seqs; a run-time value above it adds sizes above the plan at the plan's
    spacing (memory.cuda_graph_batch_sizes: every 8 to 256, every 16 above), so a step of n rows
    replays a graph at most 15 rows larger, not one of max_num_seqs rows."""
    top = max(planned, default=0)
    above = {size for size in memory.cuda_graph_batch_sizes(max_num_seqs) if size > top}
    return sorted({size for size in planned if size < max_num_seqs} | above | {max_num_seqs})


def padded_batch_size(batch_sizes: list[int], num_seqs: int) -> int | None:
    """The smallest of the ascending batch_sizes that holds num_seqs rows; None above the largest."""
    return next((size for size in batch_sizes if size >= num_seqs), None)


class StaticInputs:
    """The graphs' inputs: one buffer each, with rows for the largest batch size. Every row starts
    as a padding row (scratch slot, context_len 1, block table row = [scratch block, ...])."""

    def __init__(self, max_batch_size: int, max_num_blocks: int, scratch_block: int, block_size: int,
                 device: torch.device, scratch_state_slot: int | None = None):
        """scratch_state_slot: a hybrid model's state slot no request holds (runtime/models/gated_deltanet.py), which
        padding rows read and write; None: a model without states (no state_slots buffer)."""
        self.scratch_block = scratch_block
        self.scratch_state_slot = scratch_state_slot
        self.state_slots = (None if scratch_state_slot is None else
                            torch.full((max_batch_size,), scratch_state_slot, dtype=torch.long, device=device))
        self.scratch_slot = scratch_block * block_size  # slot 0 of the scratch block
        self.input_ids = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch_size, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_batch_size,), self.scratch_slot, dtype=torch.long, device=device)
        # [max_batch_size, max_num_blocks]: a row's entries past its context are never read
        self.block_tables = torch.full((max_batch_size, max_num_blocks), scratch_block, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(max_batch_size, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(max_batch_size, device=device)  # not read by the graph

    def batch(self, batch_size: int, max_context_len: int) -> ForwardBatch:
        """The ForwardBatch of the first batch_size rows: views of the buffers, one query each."""
        return ForwardBatch(
            positions=self.positions[:batch_size],
            slot_mapping=self.slot_mapping[:batch_size],
            block_tables=self.block_tables[:batch_size],
            context_lens=self.context_lens[:batch_size],
            query_lens=[1] * batch_size,
            max_context_len=max_context_len,
            logits_indices=self.logits_indices[:batch_size],
            state_slots=None if self.state_slots is None else self.state_slots[:batch_size],
        )

    def load(self, input_ids: Tensor, batch: ForwardBatch, batch_size: int) -> None:
        """Copy a decode step of n <= batch_size sequences into rows 0..n-1; rows n..batch_size-1
        become padding rows (an earlier, larger step may have left a real sequence there)."""
        n = batch.num_seqs
        self.input_ids[:n].copy_(input_ids)  # [n]: one token per sequence
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.context_lens[:n].copy_(batch.context_lens)
        self.block_tables[:n, : batch.block_tables.shape[1]].copy_(batch.block_tables)
        self.slot_mapping[n:batch_size].fill_(self.scratch_slot)
        self.context_lens[n:batch_size].fill_(1)
        self.block_tables[n:batch_size, 0].fill_(self.scratch_block)
        if self.state_slots is not None:  # (a padding row starts from zero state: context_len 1)
            self.state_slots[:n].copy_(batch.state_slots)
            self.state_slots[n:batch_size].fill_(self.scratch_state_slot)


class CudaGraphs:
    """The captured decode graphs of one model runner, and their replay."""

    def __init__(self, model: DecoderModel, batch_sizes: list[int], max_model_len: int, block_size: int,
                 scratch_block: int, device: torch.device, forward: Callable[[Tensor, ForwardBatch], Tensor] | None = None,
                 lora_slots=None, scratch_state_slot: int | None = None):
        """`forward(input_ids, batch) -> [num_seqs, hidden_size]`: what is captured (default: the whole
        model's forward; a parallel rank passes its stage's part, collectives included: every rank
        of the engine captures the same sizes in the same order, so the collectives meet).
        `lora_slots`: run-time LoRA's LoraSlots (runtime/lora.py) under cudagraph_specialize_lora: each size
        is captured with the LoRA sums (slots.active) and without, and a step replays the one its
        slots.active names. `scratch_state_slot`: a hybrid model's (StaticInputs)."""
        self.model = model
        self.lora_slots = lora_slots
        self.forward = forward if forward is not None else model
        self.batch_sizes = sorted(batch_sizes)
        self.max_model_len = max_model_len
        self.device = device
        self.graphs: dict[tuple[int, bool | None], torch.cuda.CUDAGraph] = {}  # (batch size, LoRA on) → graph
        self.pool = None  # the memory pool all graphs share, from the first (largest) capture
        self.num_replays = 0
        torch.cuda.synchronize(device)
        free_before, reserved_before = torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(device)
        start = time.perf_counter()
        max_num_blocks = -(-max_model_len // block_size)
        self.inputs = StaticInputs(self.batch_sizes[-1], max_num_blocks, scratch_block, block_size, device,
                                   scratch_state_slot)
        # [max batch size, hidden_size]: what every graph writes its final hidden states to
        self.hidden = torch.zeros(self.batch_sizes[-1], model.config.hidden_size, dtype=getattr(torch, model.config.dtype),
                                  device=device)
        # [max batch size, aux_width]: the hidden states an EAGLE head reads (DecoderModel.keep_hidden), when kept
        self.aux = aux_buffer(model, self.batch_sizes[-1], device)
        with torch.cuda.device(device):  # a data-parallel replica's GPU need not be the thread's current one
            # torch's default capture stream lives on the device of the process's first capture
            self.capture_stream = torch.cuda.Stream(device)
            self.capture()
        self.capture_seconds = time.perf_counter() - start
        torch.cuda.empty_cache()  # the warm-up runs' intermediates are not graph memory
        self.pool_bytes = torch.cuda.memory_reserved(device) - reserved_before
        self.graph_bytes = free_before - torch.cuda.mem_get_info(device)[0]  # pool, buffers and graph objects

    @torch.inference_mode()
    def capture(self) -> None:
        variants = (True, False) if self.lora_slots is not None else (None,)
        for batch_size in reversed(self.batch_sizes):
            batch = self.inputs.batch(batch_size, self.max_model_len)
            input_ids = self.inputs.input_ids[:batch_size]
            for lora in variants:
                if lora is not None:
                    self.lora_slots.active = lora
                self.hidden[:batch_size] = self.forward(input_ids, batch)  # warm-up: compiles this shape's kernels
                torch.cuda.synchronize(self.device)
                # the warm-up's index tensors (kernels' per-step cache) are not the graph's: made again in it, so a
                # replay never reads memory freed after capture (an illegal address, session 45's MLA rows)
                batch.kernel_cache.clear()
                graph = torch.cuda.CUDAGraph()
                # thread_local: another replica's engine thread may run its steps meanwhile
                with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream, capture_error_mode="thread_local"):
                    self.hidden[:batch_size] = self.forward(input_ids, batch)
                    if self.aux is not None:
                        self.aux[:batch_size].copy_(self.model.aux_hidden)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[(batch_size, lora)] = graph
        if self.lora_slots is not None:
            self.lora_slots.active = True  # the other graphs (piecewise, mixed) are captured with the sums
        torch.cuda.synchronize(self.device)

    def log_capture(self, allowance_bytes: int) -> None:
        sizes = self.batch_sizes
        logger.info("CUDA graphs: captured %d batch sizes (%s) in %.1f s, %.1f MiB of GPU memory (pool %.1f MiB; "
                    "allowance %.1f MiB)", len(sizes), _sizes_text(sizes), self.capture_seconds,
                    self.graph_bytes / memory.MIB, self.pool_bytes / memory.MIB, allowance_bytes / memory.MIB)
        memory.warn_over_allowance("CUDA graphs", self.graph_bytes, allowance_bytes, "set enforce_eager")

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.is_decode and batch.num_seqs <= self.batch_sizes[-1]
                and batch.block_tables.shape[1] <= self.inputs.block_tables.shape[1])

    def run(self, input_ids: Tensor, batch: ForwardBatch) -> Tensor:
        """The final hidden states [num_seqs, hidden_size] of a decode step, by replaying the graph of
        the next batch size up. The result is a view of the graphs' output buffer: use it before the
        next replay."""
        batch_size = padded_batch_size(self.batch_sizes, batch.num_seqs)
        self.inputs.load(input_ids, batch, batch_size)
        lora = None if self.lora_slots is None else self.lora_slots.active
        with torch.cuda.device(self.device):  # replay launches on the current device's stream
            self.graphs[(batch_size, lora)].replay()
        self.num_replays += 1
        if self.aux is not None:
            self.model.aux_hidden = self.aux[: batch.num_seqs]
        return self.hidden[: batch.num_seqs]


@torch.inference_mode()
def compile_mixed_step(model: DecoderModel, scratch_block: int, block_size: int, max_model_len: int,
                       device: torch.device, pieces=None, has_decode_graphs: bool = True) -> None:
    """Forwards of what eager steps hold, on the scratch block (junk by design), outputs dropped:
    decode rows beside a 2-token prefill, one for each decode-attention variant an eager step can
    launch (kernels.attention.eager_decode_cases: not split; split and merged in the decode kernel);
    without decode graphs (cudagraph_mode PIECEWISE), also
    those rows alone, eagerly and through `pieces` (runtime/piecewise_graphs.py). The graphs' capture
    compiles the kernels the graphs hold; these compile those of the eager steps and of the attention
    between piecewise graphs (the indexed decode attention, the prefill attention on this cache's
    dtype, the linears at a few generic M) at start, not in the middle of the first requests' steps
    (0.4-1 s each on an H100, the GPU idle)."""
    slot = scratch_block * block_size
    for rows, max_context_len in eager_decode_cases(model.layout.num_kv_heads, max_model_len, device_num_sms(device)):
        for prefill in ([0, 1], []) if not has_decode_graphs else ([0, 1],):
            batch = ForwardBatch(
                positions=torch.tensor([0] * rows + prefill, device=device),
                slot_mapping=torch.tensor([slot] * rows + [slot + 1 + p for p in prefill], device=device),
                block_tables=torch.full((rows + (1 if prefill else 0), 1), scratch_block, dtype=torch.int32,
                                        device=device),
                context_lens=torch.tensor([1] * rows + ([2] if prefill else []), dtype=torch.int32, device=device),
                query_lens=[1] * rows + ([2] if prefill else []),
                max_context_len=max_context_len,
                logits_indices=torch.tensor([rows - 1] + ([rows + 1] if prefill else []), device=device),
            )
            input_ids = torch.zeros(rows + len(prefill), dtype=torch.long, device=device)
            for forward in (model,) if pieces is None or prefill else (model, pieces.run):
                model.compute_logits(forward(input_ids, batch)[batch.logits_indices])
    torch.cuda.synchronize(device)


def aux_buffer(model: DecoderModel, rows: int, device: torch.device) -> Tensor | None:
    """The static buffer graphs copy a forward's aux_hidden to ([rows, aux_width]); None when nothing is kept.
    After a replay, the model's aux_hidden is its first rows (runtime/spec_eagle.py reads it after the step)."""
    width = model.aux_width()
    return torch.zeros(rows, width, dtype=getattr(torch, model.config.dtype), device=device) if width else None


def _sizes_text(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 8 else f"{', '.join(map(str, sizes[:6]))}, ..., {sizes[-1]}"
