"""Ministral 3 (Ministral3ForCausalLM, model_type ministral3; the text model of the published Ministral 3 3B / 8B / 14B
Mistral3ForConditionalGeneration checkpoints): Mistral's decoder with YaRN rope parameters whose
`llama_4_scaling_beta` multiplies q, after the rotary, by 1 + beta * log(1 + floor(position /
original_max_position_embeddings)) in every layer (transformers' get_llama_4_attn_scale): ModelConfig's
query_temperature_* (offset 0, every layer), read by hf_checkpoint._ministral3_config."""

from llmc.runtime.models.spec import LLAMA_GLOBALS, LLAMA_LINEARS, LLAMA_NORMS, ModelSpec

SPEC = ModelSpec(
    family="ministral3",
    architectures=("Ministral3ForCausalLM",),
    model_types=("ministral3",),
    layer_linears=LLAMA_LINEARS,
    layer_norms=LLAMA_NORMS,
    qk_norms={},
    global_tensors=LLAMA_GLOBALS,
)
