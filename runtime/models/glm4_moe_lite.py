"""GLM-4.7-Flash (Glm4MoeLiteForCausalLM, model_type glm4_moe_lite): DeepSeek-V3's layers under GLM's config.
transformers builds it from DeepseekV3Attention (multi-head latent attention: runtime/models/mla.py, rope_interleave
as V3's) and GLM-4.5's MoE, whose router is V3's (sigmoid scores chosen with e_score_correction_bias within the best
`topk_group` of `n_group` groups, renormalised where norm_topk_prob, times routed_scaling_factor; float32), beside
`n_shared_experts` shared experts run as one: so its tensors and fields are DeepSeek-V3's. What differs is read from
the config (compiler/hf_checkpoint._deepseek_config): which layers are sparse comes from `mlp_layer_types` (dense /
sparse per layer; by default the first dense, the rest sparse), not first_k_dense_replace; the defaults are
Glm4MoeLiteConfig's. The checkpoint's multi-token-prediction layer (layer num_hidden_layers, which transformers skips)
is left out, and the build says so."""

from dataclasses import replace

from llmc.runtime.models.deepseek import V3_SPEC

SPEC = replace(V3_SPEC, family="glm4_moe_lite", architectures=("Glm4MoeLiteForCausalLM",),
               model_types=("glm4_moe_lite",))
