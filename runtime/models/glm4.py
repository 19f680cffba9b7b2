"""GLM-4 (Glm4ForCausalLM, model_type glm4: GLM-4-9B-0414, GLM-Z1): the Llama decoder with four differences, each
mapped onto what the runtime has. The checkpoint stores gate and up as one gate_up_proj (gate rows, then up: Phi-3's
fused MLP member); q/k/v carry biases (attention_bias, true by default); the attention's and the MLP's outputs are
normed before their residual add (post_self_attn_layernorm, post_mlp_layernorm: Gemma's sandwich norms, plain RMSNorm
weights); and the rotary embedding rotates interleaved pairs (2i, 2i + 1) of only the leading
int(head_dim * partial_rotary_factor) dims (0.5 by default). The build permutes each q/k head's rows so that pair i
sits at (i, i + head_dim / 2), the rotate-half layout over the whole head (hf_checkpoint.rotary_fold,
ModelConfig.rotary_interleaved); the rotary table is head_dim wide with cos 1 and sin 0 in the pass-through pairs,
so every kernel (torch, Triton, onnxruntime's GroupQueryAttention) runs GLM-4 as it runs whole-head rotate-half."""

from llmc.runtime.models.spec import LLAMA_GLOBALS, FusedLinear, ModelSpec

GLM4_LINEARS = (
    FusedLinear("attn.qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "column", "input_norm"),
    FusedLinear("attn.o", ("self_attn.o_proj",), "row", "attn.qkv"),
    FusedLinear("mlp.gate_up", ("mlp.gate_up_proj",), "column", "post_attn_norm"),
    FusedLinear("mlp.down", ("mlp.down_proj",), "row", "mlp.gate_up"),
)
# runtime name → HF name. post_attn_norm keeps its role (the norm before the MLP: GLM's post_attention_layernorm);
# attn_out_norm / mlp_out_norm norm the sub-layers' outputs (GLM's post_self_attn_layernorm / post_mlp_layernorm)
GLM4_NORMS = {
    "input_norm": "input_layernorm",
    "attn_out_norm": "post_self_attn_layernorm",
    "post_attn_norm": "post_attention_layernorm",
    "mlp_out_norm": "post_mlp_layernorm",
}

SPEC = ModelSpec(
    family="glm4",
    architectures=("Glm4ForCausalLM",),
    model_types=("glm4",),
    layer_linears=GLM4_LINEARS,
    layer_norms=GLM4_NORMS,
    qk_norms={},
    global_tensors=LLAMA_GLOBALS,
)
