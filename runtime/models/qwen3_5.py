"""Qwen3.5 dense (Qwen3_5ForCausalLM, model_type qwen3_5_text; Qwen3_5ForConditionalGeneration's language model,
served as text: its text_config, its weights under model.language_model renamed as Qwen2-VL's by the TensorReader, its
vision tower not built): the first hybrid family. Its `layer_types` mix "linear_attention" layers, a Gated DeltaNet
(runtime/models/gated_deltanet.py: in_proj_qkv and in_proj_z fused as attn.in_qkvz, in_proj_b / in_proj_a kept dense
as attn.in_ba, a causal depthwise conv1d, the gated delta rule over a per-request recurrent state, a gated RMSNorm,
out_proj as attn.out), with "full_attention" layers, Qwen3-Next's attention: q_proj gives each head's q and a sigmoid
output gate (ModelConfig.attn_output_gate), per-head q/k norms, a partial rotary (rotate-half over the leading
int(head_dim * partial_rotary_factor) dims). Every RMSNorm but the DeltaNet's gated one scales by 1 + w (folded at
build time: norm_weight_offset). The text model's M-RoPE sections rotate by the same position in each section for text
tokens, so they are the plain rotary there."""

from llmc.runtime.models.spec import LLAMA_GLOBALS, LLAMA_LINEARS, LLAMA_NORMS, QK_NORMS, FusedLinear, ModelSpec

LINEAR_ATTENTION = (
    FusedLinear("attn.in_qkvz", ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"), "column", "input_norm"),
    FusedLinear("attn.out", ("linear_attn.out_proj",), "row", "attn.in_qkvz"),
)

SPEC = ModelSpec(
    family="qwen3_5",
    architectures=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
    model_types=("qwen3_5_text", "qwen3_5"),
    layer_linears=LLAMA_LINEARS + LINEAR_ATTENTION,
    layer_norms=LLAMA_NORMS,
    qk_norms=QK_NORMS,
    global_tensors=LLAMA_GLOBALS,
    norm_weight_offset=1.0,
)
