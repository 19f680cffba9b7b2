"""Qwen3 (dense): the Llama decoder with a per-head RMSNorm on q and k before rotary."""

from llmc.runtime.models.spec import LLAMA_GLOBALS, LLAMA_LINEARS, LLAMA_NORMS, QK_NORMS, ModelSpec

SPEC = ModelSpec(
    family="qwen3",
    architectures=("Qwen3ForCausalLM",),
    model_types=("qwen3",),
    layer_linears=LLAMA_LINEARS,
    layer_norms=LLAMA_NORMS,
    qk_norms=QK_NORMS,
    global_tensors=LLAMA_GLOBALS,
)
