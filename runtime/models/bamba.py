"""IBM Bamba (BambaForCausalLM, model_type bamba: ibm-ai-platform/Bamba-9B-*): Granite 4.0's hybrid decoder
(runtime/models/granitemoehybrid.py) without its multipliers: Mamba-2 layers (runtime/models/mamba2.py, `mamba.*`
as Granite 4.0's, attn.mamba_in / attn.mamba_out) in every layer but those of `attn_layer_indices`, which are Llama's
attention with rotary over the leading half of each head (partial_rotary_factor 0.5, rotate-half); every layer's MLP
a dense SwiGLU `feed_forward` (gate_proj, up_proj, down_proj) after `pre_ff_layernorm`; the final norm
`model.final_layernorm` (compiler/hf_checkpoint._bamba_config)."""

from llmc.runtime.models.granitemoehybrid import MAMBA
from llmc.runtime.models.spec import LLAMA_GLOBALS, LLAMA_LINEARS, FusedLinear, ModelSpec

SPEC = ModelSpec(
    family="bamba",
    architectures=("BambaForCausalLM",),
    model_types=("bamba",),
    layer_linears=LLAMA_LINEARS[:2] + MAMBA + (
        FusedLinear("mlp.gate_up", ("feed_forward.gate_proj", "feed_forward.up_proj"), "column", "post_attn_norm"),
        FusedLinear("mlp.down", ("feed_forward.down_proj",), "row", "mlp.gate_up"),
    ),
    layer_norms={"input_norm": "input_layernorm", "post_attn_norm": "pre_ff_layernorm"},
    qk_norms={},
    global_tensors={**LLAMA_GLOBALS, "norm.weight": "model.final_layernorm.weight"},
)
