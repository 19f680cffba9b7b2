"""Mixtral: the Mistral decoder whose MLP is a top-k mixture of experts in every layer (renormalised)."""

from llmc.runtime.models.spec import LLAMA_GLOBALS, LLAMA_LINEARS, LLAMA_NORMS, ModelSpec, MoeSpec

SPEC = ModelSpec(
    family="mixtral",
    architectures=("MixtralForCausalLM",),
    model_types=("mixtral",),
    layer_linears=LLAMA_LINEARS,
    layer_norms=LLAMA_NORMS,
    qk_norms={},
    global_tensors=LLAMA_GLOBALS,
    moe=MoeSpec(router="block_sparse_moe.gate", expert_prefix="block_sparse_moe.experts.{}.",
                gate="w1", up="w3", down="w2"),
)
