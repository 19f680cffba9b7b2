"""OLMo 2 (Olmo2ForCausalLM, model_type olmo2: allenai/OLMo-2-*): the Llama layout with its norms moved. No norm
before the attention or the MLP: each sub-layer reads the residual stream itself, and its output is normed before
the residual add (post_attention_layernorm, post_feedforward_layernorm: the runtime's sandwich attn_out_norm /
mlp_out_norm, ModelConfig.pre_norms false). q_norm and k_norm are RMSNorms over the whole q and k projections
(num_heads * head_dim and num_kv_heads * head_dim wide, ModelConfig.qk_norm_full_width), applied before the split
into heads and before the rotary embedding; under tensor parallelism the ranks all-reduce the sum of squares."""

from llmc.runtime.models.spec import LLAMA_GLOBALS, LLAMA_LINEARS, QK_NORMS, ModelSpec

# runtime name → HF name: only the sub-layers' output norms (there is no input_norm / post_attn_norm)
OLMO2_NORMS = {"attn_out_norm": "post_attention_layernorm", "mlp_out_norm": "post_feedforward_layernorm"}

SPEC = ModelSpec(
    family="olmo2",
    architectures=("Olmo2ForCausalLM",),
    model_types=("olmo2",),
    layer_linears=LLAMA_LINEARS,
    layer_norms=OLMO2_NORMS,
    qk_norms=QK_NORMS,
    global_tensors=LLAMA_GLOBALS,
)
