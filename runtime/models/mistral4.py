"""Mistral 4 (Mistral4ForCausalLM, model_type mistral4: the language model of Mistral-Small-4): DeepSeek-V3's layers
(multi-head latent attention, runtime/models/mla.py; dense SiLU MLPs in the first `first_k_dense_replace` layers, then
`n_routed_experts` experts beside `n_shared_experts` shared ones run as one), so its tensors are V3's. Its differences
are config fields (compiler/hf_checkpoint._deepseek_config): the router scores by softmax (no score bias), renormalised
where norm_topk_prob, times routed_scaling_factor (moe.deepseek_route with router_scoring softmax; groups only where
every group is kept: n_group = topk_group); the rope is YaRN over the qk_rope_head_dim dims (its
partial_rotary_factor), and q is multiplied after the rotary by Ministral 3's per-position query temperature, 1 +
llama_4_scaling_beta * log(1 + floor(position / original_max_position_embeddings)) (ModelConfig.query_temperature_*,
which MLAttention applies to the whole q). transformers 5 holds each layer's experts fused (mlp.experts.gate_up_proj,
down_proj) and saves them so: both those and per-expert names are read."""

from dataclasses import replace

from llmc.runtime.models.deepseek import V3_SPEC

SPEC = replace(V3_SPEC, family="mistral4", architectures=("Mistral4ForCausalLM",), model_types=("mistral4",))
