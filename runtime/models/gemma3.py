"""Gemma 3 text (Gemma3ForCausalLM, model_type gemma3_text): the Llama layout plus per-head q/k RMSNorm and
"sandwich" norms (the attention's and the MLP's outputs are normed before their residual add), every RMSNorm
scaling by (1 + w) (folded into the stored weight at build time), embeddings scaled by sqrt(hidden_size),
GELU-tanh gating, attention scaled by query_pre_attn_scalar^-0.5, and two rotary tables (sliding layers:
rope_local_base_freq, unscaled; full layers: rope_theta with the config's scaling). The config-dependent
parts are ModelConfig fields (compiler/hf_checkpoint.py reads them)."""

from llmc.runtime.models.spec import LLAMA_GLOBALS, LLAMA_LINEARS, QK_NORMS, ModelSpec

# runtime name → HF name. post_attn_norm keeps its role in every family: the norm before the MLP (Gemma's
# pre_feedforward_layernorm), fused with the residual add; attn_out_norm / mlp_out_norm norm the sub-layers' outputs.
GEMMA3_NORMS = {
    "input_norm": "input_layernorm",
    "attn_out_norm": "post_attention_layernorm",
    "post_attn_norm": "pre_feedforward_layernorm",
    "mlp_out_norm": "post_feedforward_layernorm",
}

SPEC = ModelSpec(
    family="gemma3",
    architectures=("Gemma3ForCausalLM",),
    model_types=("gemma3_text",),
    layer_linears=LLAMA_LINEARS,
    layer_norms=GEMMA3_NORMS,
    qk_norms=QK_NORMS,
    global_tensors=LLAMA_GLOBALS,
    norm_weight_offset=1.0,
    rope_scaling_extends_context=False,
)
