"""Llama 1/2/3/3.x and Mistral: the plain decoder (no biases, no qk-norm)."""

from llmc.runtime.models.spec import LLAMA_GLOBALS, LLAMA_LINEARS, LLAMA_NORMS, ModelSpec

SPEC = ModelSpec(
    family="llama",
    architectures=("LlamaForCausalLM", "MistralForCausalLM"),
    model_types=("llama", "mistral"),
    layer_linears=LLAMA_LINEARS,
    layer_norms=LLAMA_NORMS,
    qk_norms={},
    global_tensors=LLAMA_GLOBALS,
)
