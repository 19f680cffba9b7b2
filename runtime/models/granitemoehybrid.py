"""IBM Granite 4.0 (GraniteMoeHybridForCausalLM, model_type granitemoehybrid): its attention-only checkpoints
(granite-4.0-micro: every `layer_types` entry "attention", num_local_experts 0) and its hybrids (granite-4.0-h-*:
"mamba" layers, a Mamba-2 mixer in the attention's place, runtime/models/mamba2.py, its in_proj and out_proj as
attn.mamba_in / attn.mamba_out, its states in slots as Qwen3.5's DeltaNet's): dense Granite's four multipliers
(runtime/models/granite.py: the embedding's and the attention's as ModelConfig fields, residual_multiplier folded into
o_proj and the MLP's output_linear, 1 / logits_scaling into the final norm) with its MLP stored as `shared_mlp`:
`input_linear` [2 * shared_intermediate_size, hidden] holds gate rows then up rows (the runtime's gate_up order, as
Phi-3's gate_up_proj) and `output_linear` is down. `position_embedding_type` "rope" rotates q and k; null or "nope"
(the hybrids') rotates neither (ModelConfig.nope_layers: every layer). residual_multiplier is folded into a Mamba-2
layer's out_proj as into o_proj. With experts (num_local_experts > 0: granite-4.0-h-tiny, h-small) every layer,
Mamba-2 or attention, carries Granite MoE shared's block (runtime/models/granitemoe.py): the router and the fused
experts of `block_sparse_moe`, read as granitemoe's, and `shared_mlp` as its shared expert (moe.shared.*, in place
of mlp.*); residual_multiplier is folded into the experts' output_linear and the shared one's."""

from llmc.runtime.models.granitemoe import MOE
from llmc.runtime.models.spec import (LLAMA_GLOBALS, LLAMA_LINEARS, LLAMA_NORMS, FusedLinear, ModelSpec,
                                      shared_expert_linears)

MAMBA = (  # a Mamba-2 layer's linears, in its layers only (runtime/models/mamba2.py)
    FusedLinear("attn.mamba_in", ("mamba.in_proj",), "column", "input_norm"),
    FusedLinear("attn.mamba_out", ("mamba.out_proj",), "row", "attn.mamba_in"),
)

SPEC = ModelSpec(
    family="granitemoehybrid",
    architectures=("GraniteMoeHybridForCausalLM",),
    model_types=("granitemoehybrid",),
    layer_linears=LLAMA_LINEARS[:2] + MAMBA + (
        FusedLinear("mlp.gate_up", ("shared_mlp.input_linear",), "column", "post_attn_norm"),
        FusedLinear("mlp.down", ("shared_mlp.output_linear",), "row", "mlp.gate_up"),
    ) + shared_expert_linears(("shared_mlp.input_linear",), "shared_mlp.output_linear"),  # (with experts)
    layer_norms=LLAMA_NORMS,
    qk_norms={},
    global_tensors=LLAMA_GLOBALS,
    moe=MOE,  # (in no layer without experts: ModelConfig.moe_layers empty)
    scales_input_embeds=True,  # transformers multiplies inputs_embeds by embedding_multiplier in the forward
)
