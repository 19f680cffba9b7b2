"""`ModelSpec`: a model family described as data — names, fusions, parallel styles, what is never quantized.

The compiler reads it to rename, fuse, shard and name tensors; the runtime builds the module from the
same description (DESIGN §4: one source of truth).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FusedLinear:
    """One runtime linear of a decoder layer, made of one or more HF linears concatenated on the output dim."""

    name: str  # runtime name inside a layer, e.g. "attn.qkv"
    # HF names inside a layer, e.g. ("self_attn.q_proj", "self_attn.k_proj", ...); one name where the checkpoint
    # stores the linear fused already, in the runtime's row order (Phi-3's "self_attn.qkv_proj": q, k, v rows)
    hf_members: tuple[str, ...]
    parallel: str  # "column" (split the output dim) | "row" (split the input dim) | "replicated" (whole on every rank)
    input_from: str  # the runtime module whose output feeds this linear ("input_norm", "attn.qkv", ...)


@dataclass(frozen=True)
class MoeSpec:
    """Where an MoE layer's tensors live in the HF checkpoint (names inside a layer)."""

    router: str  # the gate [num_experts, hidden], e.g. "block_sparse_moe.gate"
    expert_prefix: str  # expert e's linears are under expert_prefix.format(e), e.g. "block_sparse_moe.experts.{}."
    # names of the expert's projections under its prefix: gate ("w1"), up ("w3"), down ("w2"); gate None: experts
    # without gate (Nemotron-H's, hidden_act relu2: moe.experts.gate_up is up's rows alone)
    gate: str | None
    up: str
    down: str
    # Granite MoE stores every expert of a layer in two tensors, (gate_up [E, 2 * width, hidden] (gate rows, then up),
    # down [E, hidden, width]): the build reads expert e's gate / up / down (the names above) as slices of them
    # (hf_checkpoint.fused_expert_tensors). None: one tensor per expert and projection.
    fused: tuple[str, str] | None = None
    # how `fused` stores them: "granite" (above), or "gpt_oss": gate_up [E, hidden, 2 * width] (input-major, gate and
    # up interleaved in its columns) and down [E, width, hidden], each with a `{name}_bias` [E, out], or in MXFP4 as
    # `{name}_blocks` / `{name}_scales` (compiler/gpt_oss_checkpoint.py); or "llama4": gate_up [E, hidden, 2 * width]
    # (input-major, gate columns then up) and down [E, width, hidden], read transposed (hf_checkpoint.fused_expert_tensors)
    fused_layout: str = "granite"
    shared_gate: str | None = None  # Qwen2-MoE: the shared expert's gate [1, hidden] (sigmoid), never quantized
    # the router's e_score_correction_bias (ModelConfig.router_score_bias) inside a layer; None: the router's own
    # (`{router}.e_score_correction_bias`, DeepSeek-V3's); MiniMax-M2 keeps it beside the gate, ERNIE 4.5 MoE under
    # "mlp.moe_statics.e_score_correction_bias" [1, num_experts]
    score_bias: str | None = None

    @property
    def score_bias_name(self) -> str:
        """The e_score_correction_bias tensor's name inside a layer."""
        return self.score_bias or f"{self.router}.e_score_correction_bias"


@dataclass(frozen=True)
class ModelSpec:
    family: str
    architectures: tuple[str, ...]  # HF `architectures` entries this spec reads
    model_types: tuple[str, ...]  # HF `model_type` values
    layer_linears: tuple[FusedLinear, ...]
    layer_norms: dict[str, str]  # runtime name in a layer → HF name in a layer
    qk_norms: dict[str, str]  # runtime → HF, present when the config has qk_norm
    global_tensors: dict[str, str]  # runtime tensor name → HF tensor name (embedding, final norm, lm_head, score)
    hf_layer_prefix: str = "model.layers."
    never_quantized: tuple[str, ...] = ("embed", "norm")  # runtime names no recipe can quantize
    moe: MoeSpec | None = None  # mixture-of-experts layers (their router is never quantized)
    # HF's RMSNorm multiplies by (norm_weight_offset + w) (Gemma: 1 + w, in float32); the compiler reads every
    # norm tensor as offset + w (hf_checkpoint.norm_fold), so the artifact and the runtime's kernels hold plain weights
    norm_weight_offset: float = 0.0
    # the rope scaling stretches max_position_embeddings into the model's context (vLLM's rule); False where
    # max_position_embeddings already is the scaled context (Gemma 3)
    rope_scaling_extends_context: bool = True
    # the embedding's multiplier (ModelConfig.embed_scale) applies to embeddings given as input too (transformers'
    # inputs_embeds: Granite multiplies them in its forward); False where it is the embedding module's own (Gemma)
    scales_input_embeds: bool = False
    # the norms of the layers in ModelConfig.pre_norm_layers, runtime → HF, where they are not layer_norms (OLMo
    # Hybrid's DeltaNet layers: Llama's); None: layer_norms in every layer
    pre_norm_layer_norms: dict[str, str] | None = None

    def layer_linear(self, name: str) -> FusedLinear:
        return next(linear for linear in self.layer_linears if linear.name == name)


LLAMA_LINEARS = (
    FusedLinear("attn.qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "column", "input_norm"),
    FusedLinear("attn.o", ("self_attn.o_proj",), "row", "attn.qkv"),
    FusedLinear("mlp.gate_up", ("mlp.gate_proj", "mlp.up_proj"), "column", "post_attn_norm"),
    FusedLinear("mlp.down", ("mlp.down_proj",), "row", "mlp.gate_up"),
)
# An MLP without gate, down(act(up(x))) (ModelConfig.gated_mlp false: Arcee's relu2, Apertus's xielu)
UP_MLP_LINEARS = (
    *LLAMA_LINEARS[:2],
    FusedLinear("mlp.up", ("mlp.up_proj",), "column", "post_attn_norm"),
    FusedLinear("mlp.down", ("mlp.down_proj",), "row", "mlp.up"),
)
# Phi-3 stores q/k/v and gate/up fused, in the runtime's row order (q, k, v; gate, up: its MLP's chunk(2))
PHI3_LINEARS = (
    FusedLinear("attn.qkv", ("self_attn.qkv_proj",), "column", "input_norm"),
    FusedLinear("attn.o", ("self_attn.o_proj",), "row", "attn.qkv"),
    FusedLinear("mlp.gate_up", ("mlp.gate_up_proj",), "column", "post_attn_norm"),
    FusedLinear("mlp.down", ("mlp.down_proj",), "row", "mlp.gate_up"),
)


# An MoE layer's shared expert (Qwen2-MoE, Granite MoE shared): a dense SiLU-gated MLP every token runs, split over the
# tensor ranks like the dense MLP; its linears exist in the MoE layers only, as mlp.* exist in the dense ones only
def shared_expert_linears(gate_up: tuple[str, ...], down: str) -> tuple[FusedLinear, FusedLinear]:
    return (FusedLinear("moe.shared.gate_up", gate_up, "column", "post_attn_norm"),
            FusedLinear("moe.shared.down", (down,), "row", "moe.shared.gate_up"))


# DeepSeek's multi-head latent attention (runtime/models/mla.py): q by q_proj, or by q_a_proj, its norm and q_b_proj
# under a q_lora_rank; kv_a_proj_with_mqa (the compressed kv and the shared rope key), its norm, kv_b_proj (k_nope and v
# per head); o_proj. Unfused: each reads another input (the norms' outputs feed q_b and kv_b). Under tensor parallelism
# the low-rank q_a and kv_a (and their norms) are whole on every rank, q / q_b and kv_b split by heads, o by heads' v.
MLA_LINEARS = (
    FusedLinear("attn.q", ("self_attn.q_proj",), "column", "input_norm"),
    FusedLinear("attn.q_a", ("self_attn.q_a_proj",), "replicated", "input_norm"),
    FusedLinear("attn.q_b", ("self_attn.q_b_proj",), "column", "attn.q_a_norm"),
    FusedLinear("attn.kv_a", ("self_attn.kv_a_proj_with_mqa",), "replicated", "input_norm"),
    FusedLinear("attn.kv_b", ("self_attn.kv_b_proj",), "column", "attn.kv_a_norm"),
    FusedLinear("attn.o", ("self_attn.o_proj",), "row", "attn.kv_b"),
)
MLA_NORMS = {"attn.q_a_norm": "self_attn.q_a_layernorm", "attn.kv_a_norm": "self_attn.kv_a_layernorm"}


def in_layer(linear: FusedLinear, config, index: int) -> bool:
    """Whether layer `index` has `linear` (`config`: the ModelConfig): the dense MLP's (mlp.*) in the dense layers, the
    shared expert's (moe.shared.*) in the MoE layers of a model that has one, the attention's in every layer (MLA's
    attn.q without a q_lora_rank, attn.q_a and attn.q_b with one); none of the attention's in a layer without a mixer,
    none of the MLP's in a layer without an MLP (Nemotron-H's single-mixer layers)."""
    if not (config.has_mixer(index) if linear.name.startswith("attn.") else config.has_mlp(index)):
        return False
    if linear.name in ("attn.in_qkvz", "attn.out"):  # a Gated DeltaNet's (Qwen3.5), in its layers only
        return config.is_linear_attention_layer(index)
    if linear.name in ("attn.mamba_in", "attn.mamba_out"):  # a Mamba-2 mixer's (Granite 4.0), in its layers only
        return config.is_mamba_layer(index)
    if linear.name in ("attn.conv_in", "attn.conv_out"):  # a short conv's (LFM2), in its layers only
        return config.is_short_conv_layer(index)
    if linear.name in ("attn.qkv", "attn.o") and not config.holds_kv(index):  # (Falcon-H1's Mamba-2 layers attend too)
        return False
    if linear.name in ("attn.q", "attn.q_a", "attn.q_b"):
        return (linear.name != "attn.q") == bool(config.q_lora_rank)
    if linear.name.startswith("mlp."):
        return not config.is_moe_layer(index)
    if linear.name.startswith("moe."):
        return config.is_moe_layer(index) and bool(config.shared_expert_intermediate_size)
    return True


def float32_norms(config) -> tuple[str, ...]:
    """The never-quantized layer tensors kept in float32 whatever the model dtype (`config`: the ModelConfig):
    DeepSeek's router weight and score bias, as transformers keeps them (_keep_in_fp32_modules_strict); gpt-oss's
    attention sinks (the kernels read them as float32 logits); a Gated DeltaNet's A_log and dt_bias (Qwen3.5: its decay
    is computed in float32); a Mamba-2 mixer's A_log, dt_bias and D (Granite 4.0, the same); Apertus's xIELU scalars
    (mlp.xielu: cast to the activations' dtype where they are used, as transformers' parameters are in the model's)."""
    return (("moe.gate", "moe.gate_bias") if config.router_in_float32 else ()) + (
        ("attn.sinks",) if config.attention_sinks else ()) + (
        ("attn.A_log", "attn.dt_bias") if config.linear_attention_layers or config.mamba_layers else ()) + (
        ("attn.D",) if config.mamba_layers else ()) + (("mlp.xielu",) if config.hidden_act == "xielu" else ())


def layer_norm_names(spec: ModelSpec, config, index: int | None = None) -> dict[str, str]:
    """A layer's norms, runtime name → HF name (`config`: the ModelConfig): the family's (layer `index`'s: its
    pre_norm_layer_norms in config.pre_norm_layers), its q/k norms where the config has them, MLA's q_a norm only under
    a q_lora_rank."""
    layer = spec.pre_norm_layer_norms if index in config.pre_norm_layers and spec.pre_norm_layer_norms else \
        spec.layer_norms
    norms = {**layer, **(spec.qk_norms if config.qk_norm else {})}
    return {name: hf for name, hf in norms.items() if name != "attn.q_a_norm" or config.q_lora_rank}


LLAMA_NORMS = {"input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm"}
QK_NORMS = {"attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}
LLAMA_GLOBALS = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    "score.weight": "score.weight",  # a sequence classifier's head (in place of lm_head)
}


def hf_member_rows(linear: FusedLinear, config) -> list[int]:
    """Output rows of each of a dense layer linear's HF members, in order (`config`: the ModelConfig): q, k and
    v each (gate and up), or all of them in one member that stores the linear fused (Phi-3's qkv_proj)."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    q_rows = 2 * q if config.attn_output_gate else q  # (Qwen3.5: each head's q, then its gate)
    parts = {"attn.qkv": [q_rows, kv, kv], "attn.o": [config.hidden_size],
             "mlp.gate_up": [config.intermediate_size] * 2, "mlp.down": [config.hidden_size],
             "mlp.up": [config.intermediate_size],
             "moe.shared.gate_up": [config.shared_expert_intermediate_size] * 2,
             "moe.shared.up": [config.shared_expert_intermediate_size],
             "moe.shared.down": [config.hidden_size]}
    if config.linear_attention_layers:
        key, value = (config.linear_num_key_heads * config.linear_key_head_dim,
                      config.linear_num_value_heads * config.linear_value_head_dim)
        parts |= {"attn.in_qkvz": [2 * key + value, value], "attn.out": [config.hidden_size]}
    if config.mamba_layers:  # z, then x, B, C, then dt
        width = config.mamba_num_heads * config.mamba_head_dim
        parts |= {"attn.mamba_in": [width + config.mamba_conv_dim + config.mamba_num_heads],
                  "attn.mamba_out": [config.hidden_size]}
    if config.short_conv_layers:  # B, C, x
        parts |= {"attn.conv_in": [3 * config.hidden_size], "attn.conv_out": [config.hidden_size]}
    if config.is_mla:
        parts |= {"attn.q": [q], "attn.q_a": [config.q_lora_rank], "attn.q_b": [q],
                  "attn.kv_a": [config.kv_lora_rank + config.qk_rope_head_dim],
                  "attn.kv_b": [config.num_heads * (config.qk_nope_head_dim + config.v_head_dim)]}
    parts = parts[linear.name]
    if len(linear.hf_members) == len(parts):
        return parts
    if len(linear.hf_members) == 1:
        return [sum(parts)]
    raise ValueError(f"{linear.name}: {len(linear.hf_members)} HF members for {len(parts)} parts")


def expert_linear_name(expert: int, projection: str) -> str:
    """An expert's linear inside a layer while the compiler handles it: "moe.experts.3.gate_up"."""
    return f"moe.experts.{expert}.{projection}"


def format_key(name: str) -> str:
    """The key of a layer linear's format: experts share their projection's ("moe.experts.gate_up")."""
    parts = name.split(".")
    if name.startswith("moe.experts.") and len(parts) == 4:
        return f"moe.experts.{parts[3]}"
    return name


def expert_of(name: str) -> int | None:
    """The expert index of "moe.experts.3.gate_up" (3); None for any other linear."""
    parts = name.split(".")
    return int(parts[2]) if name.startswith("moe.experts.") and len(parts) == 4 else None
