"""NVIDIA Nemotron-H (NemotronHForCausalLM, model_type nemotron_h: Nemotron-H 8B / 47B / 56B, NVIDIA-Nemotron-Nano-9B-v2
/ 12B-v2), its dense checkpoints. Each block is norm → one mixer → residual add, the mixer chosen by the config's
`layers_block_type` (or the older `hybrid_override_pattern`): "M" (linear_attention) a Mamba-2 mixer
(runtime/models/mamba2.py, Granite 4.0's, on the state slots), "*" (full_attention) GQA without rotary, "-" (mlp) an
MLP without gate, down_proj(relu(up_proj(x))²). Block i is the runtime's layer i: a mixer block is a layer without an
MLP (ModelConfig.no_mlp_layers), an MLP block one without a mixer (no_mixer_layers: no attention, no KV cache), its
`norm` the layer's input_norm. Tensors under `backbone.` (embeddings, norm_f). Refused by name
(compiler/hf_checkpoint._nemotron_h_config): "E" (moe) blocks, biases, per-block MLP widths, a sliding window,
another activation, a time_step_limit other than (0, inf); MTP layers are not built (logged)."""

from llmc.runtime.models.spec import FusedLinear, ModelSpec

SPEC = ModelSpec(
    family="nemotron_h",
    architectures=("NemotronHForCausalLM",),
    model_types=("nemotron_h",),
    layer_linears=(
        FusedLinear("attn.qkv", ("mixer.q_proj", "mixer.k_proj", "mixer.v_proj"), "column", "input_norm"),
        FusedLinear("attn.o", ("mixer.o_proj",), "row", "attn.qkv"),
        FusedLinear("attn.mamba_in", ("mixer.in_proj",), "column", "input_norm"),
        FusedLinear("attn.mamba_out", ("mixer.out_proj",), "row", "attn.mamba_in"),
        FusedLinear("mlp.up", ("mixer.up_proj",), "column", "input_norm"),
        FusedLinear("mlp.down", ("mixer.down_proj",), "row", "mlp.up"),
    ),
    layer_norms={"input_norm": "norm"},
    qk_norms={},
    global_tensors={"embed.weight": "backbone.embeddings.weight", "norm.weight": "backbone.norm_f.weight",
                    "lm_head.weight": "lm_head.weight"},
    hf_layer_prefix="backbone.layers.",
)
