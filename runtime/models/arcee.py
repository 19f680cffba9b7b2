"""Arcee AFM (ArceeForCausalLM, model_type arcee: arcee-ai/AFM-4.5B): Llama's decoder whose MLP has no gate,
down_proj(relu(up_proj(x))²) (transformers' ArceeMLP is NemotronMLP): hidden_act relu2, mlp.up in place of mlp.gate_up
(Nemotron-H's MLP, runtime/models/decoder.MLP). AFM-4.5B's rope is YaRN (rope_scaling / rope_parameters yarn), read
as every family's. Refused by name (compiler/hf_checkpoint._up_mlp_config): a hidden_act other than relu2, biases."""

from llmc.runtime.models.spec import LLAMA_GLOBALS, LLAMA_NORMS, UP_MLP_LINEARS, ModelSpec

SPEC = ModelSpec(
    family="arcee",
    architectures=("ArceeForCausalLM",),
    model_types=("arcee",),
    layer_linears=UP_MLP_LINEARS,
    layer_norms=LLAMA_NORMS,
    qk_norms={},
    global_tensors=LLAMA_GLOBALS,
)
