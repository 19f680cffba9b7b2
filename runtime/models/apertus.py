"""Swiss AI Apertus (ApertusForCausalLM, model_type apertus: swiss-ai/Apertus-8B / 70B): Llama's decoder with per-head
q/k RMSNorms (Qwen3's, before the rotary), its norms named attention_layernorm / feedforward_layernorm, Llama 3's rope
scaling (ApertusConfig's default) and an MLP without gate, down_proj(xIELU(up_proj(x))): hidden_act xielu, mlp.up in
place of mlp.gate_up, and each layer's learned xIELU scalars (mlp.act_fn.alpha_p, alpha_n, beta, eps) kept as the
float32 tensor mlp.xielu [4] (runtime/models/decoder.xielu computes transformers' XIELUActivation from them). Refused by
name (compiler/hf_checkpoint._up_mlp_config): a hidden_act other than xielu, attention_bias."""

from llmc.runtime.models.spec import LLAMA_GLOBALS, QK_NORMS, UP_MLP_LINEARS, ModelSpec

SPEC = ModelSpec(
    family="apertus",
    architectures=("ApertusForCausalLM",),
    model_types=("apertus",),
    layer_linears=UP_MLP_LINEARS,
    layer_norms={"input_norm": "attention_layernorm", "post_attn_norm": "feedforward_layernorm"},
    qk_norms=QK_NORMS,
    global_tensors=LLAMA_GLOBALS,
)
