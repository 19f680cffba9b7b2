"""Qwen3-Next (Qwen3NextForCausalLM, model_type qwen3_next): Qwen3.5-MoE's hybrid decoder (runtime/models/qwen3_5.py,
qwen3_5_moe.py) as its first form: a Gated DeltaNet whose q/k/v/z projections are one `in_proj_qkvz` and whose b/a
are one `in_proj_ba`, each grouped per key head ([q, k, v, z] of each key head's group, [b, a] alike), which the build
reads as Qwen3.5's in_proj_qkv / in_proj_z / in_proj_b / in_proj_a (hf_checkpoint.qwen3_next_tensors: rows regrouped,
nothing else changes); the MLP of a layer is the sparse block (Qwen2-MoE's: top-k renormalised by norm_topk_prob, a
shared expert times sigmoid(x · shared_expert_gate)) where `decoder_sparse_step` and `mlp_only_layers` say, else a
dense SiLU-gated MLP of intermediate_size."""

from dataclasses import replace

from llmc.runtime.models.qwen3_5_moe import SPEC as QWEN3_5_MOE

SPEC = replace(
    QWEN3_5_MOE,
    family="qwen3_next",
    architectures=("Qwen3NextForCausalLM",),
    model_types=("qwen3_next",),
)
