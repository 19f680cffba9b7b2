"""One rank's model shard and KV cache, and its part of a step — the same on the driver and on workers.

NOTE (schedule): one step is one pass down the pipeline. Stage 0 embeds the tokens (vocab-parallel:
an all-reduce over its tensor ranks), every stage runs its layers (two all-reduces per layer under
tensor parallelism: after o and after down) and hands (x, residual) [2, num_tokens, hidden_size] to
the same tensor rank of the next stage; the last stage applies the final norm and its lm_head rows
to the rows the driver samples from, and sends those logits [num_logits, vocab_size_per_rank] to the
driver, which concatenates them in tensor-rank order. Stages run one after another: while one
computes, the others wait (the pipeline bubble; no micro-batching yet).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from llmc.runtime import artifact as art
from llmc.runtime.kv_cache import kv_cache_config
from llmc.runtime.loader import build_model, compute_dtype
from llmc.runtime.model_runner import allocate_kv_caches, local_num_kv_blocks
from llmc.runtime.parallel.groups import ParallelGroups
from llmc.runtime.parallel.layout import RankLayout
from llmc.runtime.parallel.messages import StepMessage


class ShardRunner:
    """Loads the rank's weights file, agrees with every rank on the number of KV blocks (the
    smallest any rank has room for: the driver's scheduler hands out the same block ids to all),
    allocates the rank's KV cache and runs its part of each step.

    Always eager (no CUDA graphs, even without enforce_eager): capturing a rank's step would capture
    its NCCL collectives, so every rank would have to capture and replay in step with the others.
    The KV cache is sized without a profiling forward for the same reason (see local_num_kv_blocks).
    """

    def __init__(self, artifact_dir: Path, manifest: art.Manifest, options: art.RuntimeDefaults,
                 device: torch.device, layout: RankLayout, groups: ParallelGroups):
        self.layout = layout
        self.groups = groups
        self.device = device
        self.hidden_size = manifest.model.hidden_size
        self.dtype = compute_dtype(manifest, device)
        self.model = build_model(artifact_dir, manifest, device, options.max_model_len, layout, groups.tp)
        self.num_blocks = groups.min_over_ranks(local_num_kv_blocks(manifest, layout, options, device))
        kv_config = kv_cache_config(manifest, options, self.dtype, log=layout.rank == 0)
        self.kv_caches = allocate_kv_caches(manifest, layout, max(self.num_blocks, 1), options.block_size, device,
                                            kv_config.dtype)
        self.model.bind_kv_caches(self.kv_caches, kv_config.layer_scales(layout.layers))

    @torch.inference_mode()
    def run(self, message: StepMessage) -> Tensor | None:
        """The rank's part of one step. Returns the driver's own logits shard [num_logits,
        vocab_size_per_rank] float32 when the driver is on the last stage, else None."""
        layout = self.layout
        input_ids, batch = message.to_device(self.device)
        if layout.is_first_stage:
            x, residual = self.model.embed_tokens(input_ids), None
        else:
            carried = torch.empty(2, input_ids.shape[0], self.hidden_size, dtype=self.dtype, device=self.device)
            x, residual = self.groups.recv(carried, layout.rank - layout.tp_size)  # [2, num_tokens, hidden_size]
        x, residual = self.model.run_layers(x, residual, batch)
        if not layout.is_last_stage:
            self.groups.send(torch.stack([x, residual]), layout.rank + layout.tp_size)
            return None
        logits = self.model.compute_logits(self.model.final_norm(x, residual)[batch.logits_indices])
        if layout.rank == 0:
            return logits
        if message.num_logits:
            self.groups.send(logits, 0)
        return None
