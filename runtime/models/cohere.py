"""Cohere (CohereForCausalLM, model_type cohere: Command R, R+) and Cohere 2 (Cohere2ForCausalLM, cohere2: Command
R7B, Command A): the Llama linears in a parallel block, x + attn(norm(x)) + mlp(norm(x)), with one norm per layer
(input_layernorm; ModelConfig.parallel_block), every norm a LayerNorm without bias (ModelConfig.layer_norm), the
rotary embedding rotating interleaved pairs (2i, 2i + 1) of the whole head (as GLM-4's: the build permutes q/k's rows,
ModelConfig.rotary_interleaved), and the logits times logit_scale (folded into the final norm's weight:
hf_checkpoint.multiplier_fold). Cohere 2 alternates sliding-window and full-attention layers (layer_types, or the
older sliding_window_pattern) and rotates only on the sliding ones (ModelConfig.rope_on_full_layers false: the full
layers' table is cos 1, sin 0)."""

from dataclasses import replace

from llmc.runtime.models.spec import LLAMA_GLOBALS, FusedLinear, ModelSpec

# gate_up reads input_norm, as qkv does (the parallel block)
COHERE_LINEARS = (
    FusedLinear("attn.qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "column", "input_norm"),
    FusedLinear("attn.o", ("self_attn.o_proj",), "row", "attn.qkv"),
    FusedLinear("mlp.gate_up", ("mlp.gate_proj", "mlp.up_proj"), "column", "input_norm"),
    FusedLinear("mlp.down", ("mlp.down_proj",), "row", "mlp.gate_up"),
)
COHERE_NORMS = {"input_norm": "input_layernorm"}

SPEC = ModelSpec(
    family="cohere",
    architectures=("CohereForCausalLM",),
    model_types=("cohere",),
    layer_linears=COHERE_LINEARS,
    layer_norms=COHERE_NORMS,
    qk_norms={},
    global_tensors=LLAMA_GLOBALS,
)

# Cohere 2's tensors are Cohere's (its sliding layers are config fields: compiler/hf_checkpoint)
SPEC2 = replace(SPEC, family="cohere2", architectures=("Cohere2ForCausalLM",), model_types=("cohere2",))
