"""NVIDIA Nemotron-H (NemotronHForCausalLM, model_type nemotron_h: Nemotron-H 8B / 47B / 56B, NVIDIA-Nemotron-Nano-9B-v2
/ 12B-v2), its dense checkpoints. Each block is norm → one mixer → residual add, the mixer chosen by the config's
`layers_block_type` (or the older `hybrid_override_pattern`): "M" (linear_attention) a Mamba-2 mixer
(runtime/models/mamba2.py, Granite 4.0's, on the state slots), "*" (full_attention) GQA without rotary, "-" (mlp) an
MLP without gate, down_proj(relu(up_proj(x))²). Block i is the runtime's layer i: a mixer block is a layer without an
MLP (ModelConfig.no_mlp_layers), an MLP block one without a mixer (no_mixer_layers: no attention, no KV cache), its
`norm` the layer's input_norm. Tensors under `backbone.` (embeddings, norm_f).

"E" (moe) blocks (Nemotron 3 Nano: NVIDIA-Nemotron-3-Nano-30B-A3B) are MoE layers without a mixer (no_mixer_layers
and moe_layers; runtime/models/moe.py): transformers' NemotronHMoE. Its router (mixer.gate, with
e_score_correction_bias) is DeepSeek-V3's (moe.deepseek_route: sigmoid, n_group / topk_group, norm_topk_prob,
routed_scaling_factor, in float32); its experts (mixer.experts.{e}.up_proj / down_proj, no gate) are relu2's, read
as moe.experts.gate_up holding up's rows alone; its shared expert (mixer.shared_experts) a relu2 MLP of
moe_shared_expert_intermediate_size, moe.shared.up / moe.shared.down, added to the experts'. Refused by name
(compiler/hf_checkpoint._nemotron_h_config): biases, per-block MLP widths, a sliding window, another activation, a
time_step_limit other than (0, inf), a moe_latent_size, n_shared_experts other than 1; MTP layers are not built
(logged)."""

from llmc.runtime.models.spec import FusedLinear, ModelSpec, MoeSpec

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
        FusedLinear("moe.shared.up", ("mixer.shared_experts.up_proj",), "column", "input_norm"),
        FusedLinear("moe.shared.down", ("mixer.shared_experts.down_proj",), "row", "moe.shared.up"),
    ),
    layer_norms={"input_norm": "norm"},
    qk_norms={},
    global_tensors={"embed.weight": "backbone.embeddings.weight", "norm.weight": "backbone.norm_f.weight",
                    "lm_head.weight": "lm_head.weight"},
    hf_layer_prefix="backbone.layers.",
    moe=MoeSpec(router="mixer.gate", expert_prefix="mixer.experts.{}.", gate=None, up="up_proj", down="down_proj"),
)
