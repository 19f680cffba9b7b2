"""Qwen3-MoE: the Qwen3 decoder (q/k norms) whose MLP is a top-k mixture of experts in the layers that
`decoder_sparse_step` and `mlp_only_layers` choose (dense MLPs elsewhere); renormalised by `norm_topk_prob`."""

from llmc.runtime.models.spec import LLAMA_GLOBALS, LLAMA_LINEARS, LLAMA_NORMS, QK_NORMS, ModelSpec, MoeSpec

SPEC = ModelSpec(
    family="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    model_types=("qwen3_moe",),
    layer_linears=LLAMA_LINEARS,
    layer_norms=LLAMA_NORMS,
    qk_norms=QK_NORMS,
    global_tensors=LLAMA_GLOBALS,
    moe=MoeSpec(router="mlp.gate", expert_prefix="mlp.experts.{}.", gate="gate_proj", up="up_proj", down="down_proj"),
)
