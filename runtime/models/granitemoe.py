"""IBM Granite MoE (GraniteMoeForCausalLM, model_type granitemoe: granite-3.x-*-a*b; GraniteMoeSharedForCausalLM,
model_type granitemoeshared): dense Granite's four multipliers (runtime/models/granite.py: the embedding's and the
attention's as ModelConfig fields, residual_multiplier folded into o_proj and the experts' down (and the shared
MLP's), 1 / logits_scaling into the final norm) with a top-k mixture of experts in every layer. The router
(`block_sparse_moe.router.layer`) takes the top-k logits and softmaxes them: the top-k of the softmax, renormalised.
Every expert of a layer is stored in two tensors, `block_sparse_moe.input_linear` [E, 2 * width, hidden] (gate rows,
then up) and `output_linear` [E, hidden, width]; the build reads expert e's gate, up and down as slices of them,
under Mixtral's per-expert names (hf_checkpoint.fused_expert_tensors). The shared variant adds `shared_mlp` (its
`input_linear` gate and up rows, its `output_linear`), a shared expert every token runs (runtime/models/moe.py)."""

from llmc.runtime.models.spec import LLAMA_GLOBALS, LLAMA_LINEARS, LLAMA_NORMS, ModelSpec, MoeSpec, shared_expert_linears

MOE = MoeSpec(router="block_sparse_moe.router.layer", expert_prefix="block_sparse_moe.experts.{}.", gate="w1", up="w3",
              down="w2", fused=("block_sparse_moe.input_linear", "block_sparse_moe.output_linear"))

SPEC = ModelSpec(
    family="granitemoe",
    architectures=("GraniteMoeForCausalLM",),
    model_types=("granitemoe",),
    layer_linears=LLAMA_LINEARS,
    layer_norms=LLAMA_NORMS,
    qk_norms={},
    global_tensors=LLAMA_GLOBALS,
    moe=MOE,
)

SHARED_SPEC = ModelSpec(
    family="granitemoeshared",
    architectures=("GraniteMoeSharedForCausalLM",),
    model_types=("granitemoeshared",),
    layer_linears=LLAMA_LINEARS + shared_expert_linears(("shared_mlp.input_linear",), "shared_mlp.output_linear"),
    layer_norms=LLAMA_NORMS,
    qk_norms={},
    global_tensors=LLAMA_GLOBALS,
    moe=MOE,
)
