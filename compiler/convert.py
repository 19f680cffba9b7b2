"""HF tensors → runtime tensors: rename, fuse (q,k,v → qkv; gate,up → gate_up), cast, pack.

The runtime's own module, built on the meta device (per rank), is the list of what the artifact must
hold (names, shapes, dtypes): the compiler writes exactly that, in that order, one layer at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from llmc.compiler.hf_checkpoint import TensorReader
from llmc.quant.formats import QuantizedWeight, make_format
from llmc.runtime.artifact import ModelConfig
from llmc.runtime.models.decoder import DecoderModel
from llmc.runtime.models.spec import ModelSpec, expert_linear_name, format_key, in_layer, layer_norm_names
from llmc.runtime.parallel.layout import RankLayout


# A linear's weight before packing: float [out_features, in_features] (the dense format), or quantized.
UnpackedLinear = Tensor | QuantizedWeight


@dataclass
class LayerWeights:
    """One decoder layer in runtime names: q/k/v and gate/up already concatenated on the output dim.

    As read from the checkpoint every linear is a float tensor; a packer hands the layer back with
    each linear either still float (dense format) or a QuantizedWeight, ready to be sharded and packed.
    """

    index: int
    # "attn.qkv" → [out_features, in_features]; an MoE layer's experts one by one, every expert's gate_up
    # ("moe.experts.0.gate_up", ...), then every down: packed, they stack into "moe.experts.gate_up.*" [E, ...]
    linears: dict[str, UnpackedLinear]
    biases: dict[str, Tensor]  # "attn.qkv" → [out_features], only where the model has biases
    # never-quantized weights kept as they are: "input_norm" → [hidden_size]; an MoE layer's router
    # "moe.gate" → [num_experts, hidden_size] and Qwen2-MoE's shared expert gate "moe.shared_gate" → [1, hidden_size]
    norms: dict[str, Tensor]


# Quantizes one layer: float LayerWeights → LayerWeights whose linears are float or QuantizedWeight.
LayerPacker = Callable[[LayerWeights], LayerWeights]
# Quantizes one global module ("embed", "norm", "lm_head", a classifier's "score") the same way: weight → float or QuantizedWeight.
GlobalPacker = Callable[[str, Tensor], UnpackedLinear]


def artifact_tensor_specs(config: ModelConfig, module_formats: dict[str, dict],
                          layout: RankLayout | None = None) -> list[tuple[str, torch.dtype, tuple]]:
    """(name, dtype, shape) of every tensor the runtime will load (on `layout`'s rank), in the runtime module's order."""
    model = meta_model(config, module_formats, layout)
    return [(name, t.dtype, tuple(t.shape)) for name, t in model.state_dict().items()]


def meta_model(config: ModelConfig, module_formats: dict[str, dict], layout: RankLayout | None = None) -> DecoderModel:
    dtype = getattr(torch, config.dtype)
    formats = {name: make_format(spec, dtype) for name, spec in module_formats.items()}
    with torch.device("meta"):
        return DecoderModel(config, formats, max_positions=1, layout=layout)


def read_layer(reader: TensorReader, spec: ModelSpec, config: ModelConfig, index: int,
               skip_linears: set[str] = frozenset()) -> LayerWeights:
    """One layer's float tensors in runtime names; `skip_linears` are not read (imported quantized ones)."""
    prefix = f"{spec.hf_layer_prefix}{index}."
    linears, biases = {}, {}
    is_moe = config.is_moe_layer(index)
    for linear in spec.layer_linears:
        if not in_layer(linear, config, index):
            continue
        members = [prefix + member for member in linear.hf_members]
        if linear.name not in skip_linears:
            linears[linear.name] = torch.cat([reader.get(m + ".weight").float() for m in members])
        if (config.attention_bias and linear.name == "attn.qkv") or (config.o_bias and linear.name == "attn.o"):
            biases[linear.name] = torch.cat([reader.get(m + ".bias").float() for m in members])
    norms = {name: reader.get(f"{prefix}{hf}.weight").float()
             for name, hf in layer_norm_names(spec, config, index).items()
             if not (config.is_state_layer(index) and name in ("attn.q_norm", "attn.k_norm"))}
    if config.is_linear_attention_layer(index):
        norms |= read_linear_attention(reader, prefix)
    if config.is_mamba_layer(index):
        norms |= read_mamba(reader, spec, prefix, config)
    if config.is_short_conv_layer(index):  # LFM2: the short conv's depthwise weight [hidden, 1, L] as [hidden, L]
        norms["attn.conv"] = reader.get(f"{prefix}conv.conv.weight").float().flatten(1)
    if config.attention_sinks:  # gpt-oss: [num_heads], kept as a norm is (never quantized; float32: float32_norms)
        norms["attn.sinks"] = reader.get(f"{prefix}self_attn.sinks").float()
    if config.hidden_act == "xielu" and config.has_mlp(index) and not is_moe:  # Apertus: [alpha_p, alpha_n, beta, eps]
        norms["mlp.xielu"] = torch.stack([reader.get(f"{prefix}mlp.act_fn.{name}").float().reshape(())
                                          for name in ("alpha_p", "alpha_n", "beta", "eps")])
    if is_moe:
        linears |= read_experts(reader, spec, config, index, skip_linears)
        norms["moe.gate"] = reader.get(f"{prefix}{spec.moe.router}.weight").float()
        if config.moe_bias:  # gpt-oss: the router's bias [num_experts], every expert's gate_up and down biases
            biases["moe.gate"] = reader.get(f"{prefix}{spec.moe.router}.bias").float()
            biases |= read_experts(reader, spec, config, index, kind="bias")
        if config.shared_expert_gate:  # Qwen2-MoE's shared expert gate [1, hidden]
            norms["moe.shared_gate"] = reader.get(f"{prefix}{spec.moe.shared_gate}.weight").float()
        if config.router_score_bias:  # DeepSeek-V3's, GLM-4.5's, MiniMax-M2's, ERNIE's e_score_correction_bias [E]
            norms["moe.gate_bias"] = reader.get(f"{prefix}{spec.moe.score_bias_name}").float().reshape(-1)
    return LayerWeights(index, linears, biases, norms)


def read_linear_attention(reader: TensorReader, prefix: str) -> dict[str, Tensor]:
    """A Qwen3.5 Gated DeltaNet's dense tensors in runtime names (kept as norms are: never quantized): in_proj_b's rows
    then in_proj_a's (attn.in_ba), the depthwise conv's weight [conv_dim, kernel] (attn.conv), A_log, dt_bias and the
    gated RMSNorm's weight (attn.norm: w itself, not folded)."""
    hf = f"{prefix}linear_attn."
    return {"attn.in_ba": torch.cat([reader.get(f"{hf}in_proj_b.weight").float(),
                                     reader.get(f"{hf}in_proj_a.weight").float()]),
            "attn.conv": reader.get(f"{hf}conv1d.weight").float().flatten(1),
            "attn.A_log": reader.get(f"{hf}A_log").float(), "attn.dt_bias": reader.get(f"{hf}dt_bias").float(),
            "attn.norm": reader.get(f"{hf}norm.weight").float()}


def read_mamba(reader: TensorReader, spec: ModelSpec, prefix: str, config: ModelConfig) -> dict[str, Tensor]:
    """A Mamba-2 mixer's dense tensors in runtime names (kept as norms are: never quantized), under the module that
    holds its in_proj (Granite 4.0's `mamba.`, Nemotron-H's `mixer.`): the depthwise conv's weight [conv_dim, kernel]
    (attn.conv) and bias (attn.conv_bias, where mamba_conv_bias), dt_bias, A_log, D and the gated RMSNorm's weight
    (attn.norm: w itself; none where not mamba_rms_norm: Falcon-H1's)."""
    hf = prefix + spec.layer_linear("attn.mamba_in").hf_members[0].rpartition(".")[0] + "."
    tensors = {"attn.conv": reader.get(f"{hf}conv1d.weight").float().flatten(1),
               "attn.A_log": reader.get(f"{hf}A_log").float(), "attn.dt_bias": reader.get(f"{hf}dt_bias").float(),
               "attn.D": reader.get(f"{hf}D").float()}
    if config.mamba_rms_norm:
        tensors["attn.norm"] = reader.get(f"{hf}norm.weight").float()
    if config.mamba_conv_bias:
        tensors["attn.conv_bias"] = reader.get(f"{hf}conv1d.bias").float()
    return tensors


def read_experts(reader: TensorReader, spec: ModelSpec, config: ModelConfig, index: int,
                 skip_linears: set[str] = frozenset(), kind: str = "weight") -> dict[str, Tensor]:
    """An MoE layer's experts in runtime names: every expert's gate_up (gate rows, then up rows; up's alone where the
    MoeSpec has no gate), then every down; those in `skip_linears` ("moe.experts.3.down", imported quantized ones) are
    not read. kind "bias": their biases (gpt-oss) in the same order, [2 * width] and [hidden]."""
    moe = spec.moe
    prefixes = [f"{spec.hf_layer_prefix}{index}.{moe.expert_prefix.format(e)}" for e in range(config.num_experts)]
    members = (moe.up,) if moe.gate is None else (moe.gate, moe.up)  # (Nemotron-H's experts: up alone)
    gate_ups = {expert_linear_name(e, "gate_up"): torch.cat([reader.get(f"{p}{m}.{kind}").float() for m in members])
                for e, p in enumerate(prefixes) if expert_linear_name(e, "gate_up") not in skip_linears}
    downs = {expert_linear_name(e, "down"): reader.get(f"{p}{moe.down}.{kind}").float()
             for e, p in enumerate(prefixes) if expert_linear_name(e, "down") not in skip_linears}
    return gate_ups | downs


def stack_experts(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """{"moe.experts.{e}.{proj}.{param}": t} → {"moe.experts.{proj}.{param}": [num_experts, *t.shape]} in
    expert order (the runtime's ExpertLinears); other names pass through."""
    out, groups = {}, {}
    for name, tensor in tensors.items():
        parts = name.split(".")
        if name.startswith("moe.experts.") and len(parts) >= 5 and parts[2].isdigit():
            groups.setdefault(".".join(["moe.experts", *parts[3:]]), []).append((int(parts[2]), tensor))
        else:
            out[name] = tensor
    for name, members in groups.items():
        out[name] = torch.stack([t for _, t in sorted(members, key=lambda m: m[0])])
    return out


def dense_packer(layer: LayerWeights) -> LayerWeights:
    """The packer of an unquantized build: every linear stays float, packed in the dense format."""
    return layer


def dense_global_packer(module: str, weight: Tensor) -> Tensor:
    return weight


def pack_layer(layer: LayerWeights, module_formats: dict[str, dict], dtype: torch.dtype,
               float32_norms: tuple[str, ...] = ()) -> dict[str, Tensor]:
    """A layer's runtime tensors (names inside the layer): each linear packed in its planned format,
    biases and norms cast to the model dtype, except `float32_norms` (DeepSeek's router: spec.float32_norms)."""
    out = {}
    for name, weight in layer.linears.items():
        for param, tensor in pack_linear(weight, module_formats[f"layers.{layer.index}.{format_key(name)}"], dtype).items():
            out[f"{name}.{param}"] = tensor
    for name, bias in layer.biases.items():
        out[f"{name}.bias"] = bias.to(dtype)
    for name, weight in layer.norms.items():
        out[f"{name}.weight"] = weight.to(torch.float32 if name in float32_norms else dtype)
    return stack_experts(out)


def pack_linear(weight: UnpackedLinear, fmt_spec: dict, dtype: torch.dtype) -> dict[str, Tensor]:
    fmt = make_format(fmt_spec, dtype)
    return fmt.pack(weight) if isinstance(weight, QuantizedWeight) else fmt.pack_dense(weight)


def pack_global(module: str, weight: UnpackedLinear, module_formats: dict[str, dict], dtype: torch.dtype) -> dict[str, Tensor]:
    """{runtime tensor name: tensor} of "embed", "norm", "lm_head" or "score"."""
    if module == "lm_head":
        return {f"lm_head.{k}": v for k, v in pack_linear(weight, module_formats["lm_head"], dtype).items()}
    return {f"{module}.weight": weight.to(dtype)}


def global_modules(config: ModelConfig) -> list[str]:
    """The non-layer modules, in the runtime module's order."""
    if config.is_classifier:
        return ["embed", "norm", "score"]
    return ["embed", "norm"] + ([] if config.tie_word_embeddings else ["lm_head"])


def read_global(reader: TensorReader, spec: ModelSpec, module: str, padded_vocab_size: int) -> Tensor:
    """A global module's float weight; embedding and lm_head rows zero-padded to `padded_vocab_size`."""
    weight = reader.get(spec.global_tensors[f"{module}.weight"]).float()
    if module in ("embed", "lm_head") and weight.shape[0] < padded_vocab_size:
        padding = weight.new_zeros(padded_vocab_size - weight.shape[0], weight.shape[1])
        weight = torch.cat([weight, padding])  # rows no token id reaches; their logits are cut off
    return weight
