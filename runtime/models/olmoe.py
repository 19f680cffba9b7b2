"""OLMoE (OlmoeForCausalLM, model_type olmoe: allenai/OLMoE-1B-7B-*): the Llama layout (pre-norms) with OLMo 2's q/k
norms (RMSNorms over the whole q and k projections, before the split into heads: ModelConfig.qk_norm_full_width) and a
top-k mixture of experts in every layer, renormalised by `norm_topk_prob` (false in OLMoE's config). Its `clip_qkv`
(OLMo 1's clamping of q/k/v) is refused by name when set."""

from llmc.runtime.models.spec import LLAMA_GLOBALS, LLAMA_LINEARS, LLAMA_NORMS, QK_NORMS, ModelSpec, MoeSpec

SPEC = ModelSpec(
    family="olmoe",
    architectures=("OlmoeForCausalLM",),
    model_types=("olmoe",),
    layer_linears=LLAMA_LINEARS,
    layer_norms=LLAMA_NORMS,
    qk_norms=QK_NORMS,
    global_tensors=LLAMA_GLOBALS,
    moe=MoeSpec(router="mlp.gate", expert_prefix="mlp.experts.{}.", gate="gate_proj", up="up_proj", down="down_proj"),
)
