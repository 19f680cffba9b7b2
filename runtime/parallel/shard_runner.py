"""One rank's model shard, KV cache and decode graphs, and its part of a step — the same on the
driver and on workers.

NOTE (schedule): one step is one pass down the pipeline. Stage 0 embeds the tokens (vocab-parallel:
an all-reduce over its tensor ranks), every stage runs its layers (two all-reduces per layer under
tensor parallelism: after o and after down) and hands (x, residual) [2, num_tokens, hidden_size] to
the same tensor rank of the next stage; the last stage applies the final norm and its lm_head rows
to the rows the driver samples from, and sends those logits [num_logits, vocab_size_per_rank] to the
driver, which concatenates them in tensor-rank order. Stages run one after another: while one
computes, the others wait (the pipeline bubble; no micro-batching yet).

NOTE (lockstep): whatever a rank does with collectives, every rank does at the same point, in the
same order, with the same sizes, so the collectives meet: at start the profiling forward (GPU:
each rank measures its own activation peak; its stage's all-reduces run with its tensor ranks,
stages do not talk), then the exchange of every rank's KV-block count (the engine takes the
smallest), then the capture of one decode graph per planned batch size (largest first, the CUDA
graphs of runtime/cuda_graphs.py, as on one GPU: each graph holds the rank's all-reduces and its
stage hand-offs). Each step, all ranks decide alike whether it replays a graph (from the
ForwardBatch alone), and pad it to the same size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from llmc.kernels import device_num_sms
from llmc.runtime import artifact as art
from llmc.runtime import memory
from llmc.runtime.cuda_graphs import CudaGraphs, can_use_graphs, graph_batch_sizes
from llmc.runtime.forward_batch import ForwardBatch
from llmc.runtime.kv_cache import kv_cache_config
from llmc.runtime.loader import build_model, compute_dtype
from llmc.runtime.memory_profile import measure_kv_plan
from llmc.runtime.model_runner import allocate_kv_caches, local_num_kv_blocks
from llmc.runtime.parallel.groups import ParallelGroups
from llmc.runtime.parallel.layout import RankLayout, kv_bytes_per_token
from llmc.runtime.parallel.messages import StepMessage


@dataclass(frozen=True)
class RankMemory:
    """What one rank reported at start. measured: a profiled GPU plan (weight and activation bytes
    measured); else the blocks came from num_kv_blocks or cpu_kv_cache_gib and the bytes are 0."""

    rank: int
    num_kv_blocks: int
    weight_bytes: int
    activation_bytes: int
    measured: bool


class ShardRunner:
    """Loads the rank's weights file, measures its memory plan, agrees with every rank on the number
    of KV blocks (the smallest any rank has room for: the driver's scheduler hands out the same block
    ids to all), allocates the rank's KV cache, captures its decode graphs and runs its part of each
    step."""

    def __init__(self, artifact_dir: Path, manifest: art.Manifest, options: art.RuntimeDefaults,
                 device: torch.device, layout: RankLayout, groups: ParallelGroups):
        self.layout = layout
        self.groups = groups
        self.device = device
        self.hidden_size = manifest.model.hidden_size
        self.dtype = compute_dtype(manifest, device)
        allocated_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        self.model = build_model(artifact_dir, manifest, device, options.max_model_len, layout, groups.tp)
        kv_config = kv_cache_config(manifest, options, self.dtype, log=layout.rank == 0)
        # every rank captures or none does (Triton could be missing on one host)
        # decode graphs only (PIECEWISE and FULL are refused for parallel artifacts: options.graph_mode_problem)
        can_capture = groups.min_over_ranks(int(can_use_graphs(device, options.enforce_eager
                                                               or not options.graph_modes.has_full_decode)))
        graph_sizes = graph_batch_sizes(manifest.plan.cuda_graph_batch_sizes, options.max_num_seqs) if can_capture else []
        graph_allowance = memory.graph_allowance_bytes(manifest.model, graph_sizes, options.max_model_len,
                                                       device_num_sms(device) if device.type == "cuda" else memory.DEFAULT_NUM_SMS,
                                                       layout, options.block_size)  # the split over this rank's heads
        self.memory_plan = None
        if device.type == "cuda" and options.num_kv_blocks is None:  # every rank profiles at once
            weight_bytes = torch.cuda.memory_allocated(device) - allocated_before
            self.memory_plan = measure_kv_plan(self.model, options, device, weight_bytes,
                                               kv_bytes_per_token(manifest.model, layout, kv_config.dtype.itemsize),
                                               graph_allowance, step=self.profile_step)
        self.rank_memory = self._exchange_memory(manifest, options)
        self.num_blocks = min(report.num_kv_blocks for report in self.rank_memory)
        # the scheduler hands out blocks 0..num_blocks-1; block num_blocks is the graphs' scratch block
        num_allocated = max(self.num_blocks, 1) + (1 if graph_sizes else 0)
        self.kv_caches = allocate_kv_caches(manifest, layout, num_allocated, options.block_size, device, kv_config.dtype)
        self.model.bind_kv_caches(self.kv_caches, kv_config.layer_scales(layout.layers))
        self.graphs: CudaGraphs | None = None
        if graph_sizes:  # in lockstep: every rank, the same sizes, the same order
            self.graphs = CudaGraphs(self.model, graph_sizes, options.max_model_len, options.block_size,
                                     scratch_block=self.num_blocks, device=device, forward=self.stage_forward)
            self.graphs.log_capture(graph_allowance)

    def _exchange_memory(self, manifest: art.Manifest, options: art.RuntimeDefaults) -> list[RankMemory]:
        """Every rank's report, in rank order (a control-group all-gather)."""
        plan = self.memory_plan
        if plan is not None:
            mine = [plan.num_kv_blocks, plan.weight_bytes, plan.activation_bytes, 1]
        else:
            mine = [local_num_kv_blocks(manifest, self.layout, options, self.device), 0, 0, 0]
        return [RankMemory(rank, blocks, weights, activations, bool(measured))
                for rank, (blocks, weights, activations, measured) in enumerate(self.groups.gather_ints(mine))]

    def stage_forward(self, input_ids: Tensor, batch: ForwardBatch) -> Tensor:
        """The rank's stage of one forward, collectives included (what a decode graph captures):
        [num_tokens, hidden_size], the normed final hidden states on the last stage, else the
        hidden states handed on."""
        layout = self.layout
        if layout.is_first_stage:
            x, residual = self.model.embed_tokens(input_ids), None
        else:
            carried = torch.empty(2, input_ids.shape[0], self.hidden_size, dtype=self.dtype, device=self.device)
            self.groups.recv(carried, layout.rank - layout.tp_size)  # [2, num_tokens, hidden_size]
            x, residual = carried[0], carried[1]
        x, residual = self.model.run_layers(x, residual, batch)
        if not layout.is_last_stage:
            self.groups.send(torch.stack([x, residual]), layout.rank + layout.tp_size)
            return x
        return self.model.final_norm(x, residual)

    def profile_step(self, input_ids: Tensor, batch: ForwardBatch) -> Tensor:
        """The memory profile's work on this rank: its stage as in a step, without the hand-offs
        (the stages profile at once; a non-first stage starts from zeros of the received shape)."""
        layout = self.layout
        if layout.is_first_stage:
            x, residual = self.model.embed_tokens(input_ids), None
        else:
            carried = torch.zeros(2, input_ids.shape[0], self.hidden_size, dtype=self.dtype, device=self.device)
            x, residual = carried[0], carried[1]
        x, residual = self.model.run_layers(x, residual, batch)
        if not layout.is_last_stage:
            return torch.stack([x, residual])
        logits = self.model.compute_logits(self.model.final_norm(x, residual)[batch.logits_indices])
        return torch.softmax(logits, dim=-1)

    @torch.inference_mode()
    def run(self, message: StepMessage, pending: Tensor | None = None) -> Tensor | None:
        """The rank's part of one step. `pending` (driver only): the previous step's sampled tokens
        on the device, for the message's placeholders. Returns the driver's own logits shard
        [num_logits, vocab_size_per_rank] float32 when the driver is on the last stage, else None."""
        layout = self.layout
        step = message.to_device(self.device)
        if step.num_pending and layout.is_first_stage:  # placeholders: filled on the device
            tokens = pending.contiguous() if pending is not None else torch.empty(
                step.num_pending, dtype=torch.long, device=self.device)
            if self.groups.tp is not None:
                self.groups.tp.broadcast(tokens)
            step.input_ids[step.fixup_dst] = tokens[step.fixup_src]
        batch = step.batch
        if self.graphs is not None and self.graphs.can_run(batch):
            hidden = self.graphs.run(step.input_ids, batch)  # [num_seqs, hidden_size]
        else:
            hidden = self.stage_forward(step.input_ids, batch)
        if not layout.is_last_stage:
            return None
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        if layout.rank == 0:
            return logits
        if message.num_logits:
            self.groups.send(logits, 0)
        return None
