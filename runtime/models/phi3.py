"""Phi-3 (Phi-3-mini/medium 4k, Phi-4): the Llama decoder, its checkpoint storing q/k/v as one qkv_proj and
gate/up as one gate_up_proj (the runtime's own fusions, in the same row order)."""

from llmc.runtime.models.spec import LLAMA_GLOBALS, LLAMA_NORMS, PHI3_LINEARS, ModelSpec

SPEC = ModelSpec(
    family="phi3",
    architectures=("Phi3ForCausalLM",),
    model_types=("phi3",),
    layer_linears=PHI3_LINEARS,
    layer_norms=LLAMA_NORMS,
    qk_norms={},
    global_tensors=LLAMA_GLOBALS,
)
