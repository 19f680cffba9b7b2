"""DeepSeek-V2 (DeepseekV2ForCausalLM, model_type deepseek_v2: DeepSeek-V2-Lite(-Chat), DeepSeek-Coder-V2-Lite) and
DeepSeek-V3 (DeepseekV3ForCausalLM, deepseek_v3: DeepSeek-V3, R1, Moonlight-16B-A3B): multi-head latent attention
(runtime/models/mla.py, over vLLM's latent KV cache) in every layer; dense SiLU MLPs in the first `first_k_dense_replace`
layers, then mixtures of `n_routed_experts` experts with `n_shared_experts` shared ones, which run as one shared expert
of n_shared_experts * moe_intermediate_size (Qwen2-MoE's, ungated), routed by DeepSeek's routers (runtime/models/moe.py
`deepseek_route`: V2's softmax top-k, V3's sigmoid with e_score_correction_bias, groups, routed_scaling_factor).
V3's multi-token-prediction layer (layer num_hidden_layers, an MLA + MoE layer) is no layer of this model: the build
keeps it apart (compiler/mtp.py) for speculative method mtp (runtime/mtp_head.py, its own one-layer latent cache)."""

from dataclasses import replace

from llmc.runtime.models.spec import (LLAMA_GLOBALS, LLAMA_LINEARS, LLAMA_NORMS, MLA_LINEARS, MLA_NORMS, ModelSpec,
                                      MoeSpec, shared_expert_linears)

_LINEARS = MLA_LINEARS + LLAMA_LINEARS[2:] + shared_expert_linears(
    ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"), "mlp.shared_experts.down_proj")
_MOE = MoeSpec(router="mlp.gate", expert_prefix="mlp.experts.{}.", gate="gate_proj", up="up_proj", down="down_proj")

V2_SPEC = ModelSpec(
    family="deepseek_v2",
    architectures=("DeepseekV2ForCausalLM",),
    model_types=("deepseek_v2",),
    layer_linears=_LINEARS,
    layer_norms={**LLAMA_NORMS, **MLA_NORMS},
    qk_norms={},
    global_tensors=LLAMA_GLOBALS,
    moe=_MOE,
)

# V3's tensors are V2's (its routing differs by config fields: compiler/hf_checkpoint._deepseek_fields)
V3_SPEC = replace(V2_SPEC, family="deepseek_v3", architectures=("DeepseekV3ForCausalLM",), model_types=("deepseek_v3",))
