"""GLM-4.5 / GLM-4.6 (Glm4MoeForCausalLM, model_type glm4_moe: GLM-4.5, GLM-4.5-Air, GLM-4.6): the Llama decoder
(separate q/k/v and gate/up projections, pre-norms only: none of dense GLM-4's sandwich norms) with q/k/v biases
(attention_bias), per-head q/k RMSNorms where use_qk_norm (Qwen3's), dense SiLU MLPs in the first
`first_k_dense_replace` layers, then DeepSeek-V3's mixture of experts: `n_routed_experts` routed by sigmoid scores
chosen with e_score_correction_bias within the best `topk_group` of `n_group` groups, renormalised where
norm_topk_prob, times routed_scaling_factor (runtime/models/moe.py `deepseek_route`, on a float32 router as
transformers keeps it), beside `n_shared_experts` shared ones run as one shared expert (DeepSeek's).

The rotary embedding rotates the leading int(head_dim * partial_rotary_factor) dims of each head (0.5 by default) in
the rotate-half layout over those dims, pairs (i, i + rotary_dim / 2): not dense GLM-4's interleaved pairs. The build
permutes each q/k head's rows (weights, biases and the q/k norms' weights: hf_checkpoint.rotary_fold) so that
pair i sits at (i, i + head_dim / 2), the rotate-half layout over the whole head, and the rotary table is head_dim
wide with cos 1, sin 0 in the pass-through pairs (ModelConfig.rotary_rows_permuted), as GLM-4's: every kernel (torch,
Triton, CUDA graphs) rotates whole heads. The checkpoint's multi-token-prediction layer (num_nextn_predict_layers:
GLM-4.5 ships one, as layer num_hidden_layers) is no layer of this model: the build keeps it apart (compiler/mtp.py)
for speculative method mtp (runtime/mtp_head.py), as DeepSeek-V3's is."""

from llmc.runtime.models.spec import (LLAMA_GLOBALS, LLAMA_LINEARS, LLAMA_NORMS, QK_NORMS, ModelSpec, MoeSpec,
                                      shared_expert_linears)

SPEC = ModelSpec(
    family="glm4_moe",
    architectures=("Glm4MoeForCausalLM",),
    model_types=("glm4_moe",),
    layer_linears=LLAMA_LINEARS + shared_expert_linears(
        ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"), "mlp.shared_experts.down_proj"),
    layer_norms=LLAMA_NORMS,
    qk_norms=QK_NORMS,  # where the config has use_qk_norm (GLM-4.5; not GLM-4.5-Air)
    global_tensors=LLAMA_GLOBALS,
    moe=MoeSpec(router="mlp.gate", expert_prefix="mlp.experts.{}.", gate="gate_proj", up="up_proj", down="down_proj"),
)
