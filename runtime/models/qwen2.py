"""Qwen2 / Qwen2.5: the Llama decoder with biases on q, k and v (and often tied embeddings)."""

from llmc.runtime.models.spec import LLAMA_GLOBALS, LLAMA_LINEARS, LLAMA_NORMS, ModelSpec

SPEC = ModelSpec(
    family="qwen2",
    architectures=("Qwen2ForCausalLM",),
    model_types=("qwen2",),
    layer_linears=LLAMA_LINEARS,
    layer_norms=LLAMA_NORMS,
    qk_norms={},
    global_tensors=LLAMA_GLOBALS,
)
