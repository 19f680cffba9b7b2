"""Quantizing a model layer by layer: which format each linear gets, and the algorithms that fill it.

NOTE (algorithm): calibration hidden states [num_samples, seq_len, hidden] flow through the model one
decoder layer at a time. For layer i the packer (1) builds the runtime's float32 layer from the
checkpoint, (2) quantizes its linears with the recipe's method, reading the inputs that reach them
through the already-quantized layers 0..i-1 (GPTQ quantizes qkv, o, gate_up, down in turn, each seeing
the inputs its quantized predecessors produce, and with float targets fits them to the float model's
outputs, carried alongside as a second stream of hidden states; AWQ searches scales on the float layer, folds them
into the preceding norm or linear, then searches clipping), (3) replaces the weights with their
dequantized values and runs the layer to produce layer i+1's inputs. Held-out windows flow through
both the float and the quantized layers, so the build can report what quantization cost.
"""

from __future__ import annotations

import fnmatch
import logging
import re

import torch
from torch import Tensor

from llmc.compiler.awq_layer import awq_quantize_layer
from llmc.compiler.calibration import LayerRunner, capture_inputs
from llmc.compiler.convert import LayerWeights
from llmc.compiler.moe_calibration import expert_input_absmax, gptq_experts, is_expert_group, linear_groups
from llmc.compiler.recipe import QuantizationConfig
from llmc.errors import RecipeError
from llmc.quant.formats import DenseFormat, QuantizedWeight, num_groups_of
from llmc.quant.fp8 import AbsmaxObserver, quantize_fp8_weight, quantize_fp8_weight_block
from llmc.quant.gptq import HessianAccumulator, float_target_weight, gptq_quantize
from llmc.quant.reference import dequantize_weight
from llmc.quant.rtn import rtn_quantize
from llmc.runtime.artifact import ModelConfig
from llmc.runtime.models.decoder import DecoderLayer
from llmc.runtime.models.spec import ModelSpec, expert_of, format_key, in_layer

logger = logging.getLogger("llmc")
AWQ_MAX_TOKENS = 8192  # calibration tokens kept per linear for AWQ's searches


# ---- which format each linear gets --------------------------------------------------------------


def _matches(pattern: str, names: list[str]) -> bool:
    if pattern.startswith("re:"):
        return any(re.fullmatch(pattern[3:], n) for n in names)
    return any(fnmatch.fnmatchcase(n, pattern) or n.split(".")[-1] == pattern for n in names)


def module_names(spec: ModelSpec, config: ModelConfig) -> dict[str, list[str]]:
    """Runtime linear name → the names a recipe pattern may use for it (runtime and HF member names)."""
    names = {}
    for i in range(config.num_layers):
        for linear in spec.layer_linears:
            if not in_layer(linear, config, i):
                continue
            hf = [f"{spec.hf_layer_prefix}{i}.{m}" for m in linear.hf_members]
            names[f"layers.{i}.{linear.name}"] = [f"layers.{i}.{linear.name}", *hf]
        if config.is_moe_layer(i):  # one format per projection, for all the layer's experts
            moe, experts = spec.moe, [f"{spec.hf_layer_prefix}{i}.{spec.moe.expert_prefix.format(e)}" for e in range(config.num_experts)]
            names[f"layers.{i}.moe.experts.gate_up"] = [f"layers.{i}.moe.experts.gate_up",
                                                         *(p + m for p in experts for m in (moe.gate, moe.up)
                                                           if m is not None)]  # (Nemotron-H's: no gate)
            names[f"layers.{i}.moe.experts.down"] = [f"layers.{i}.moe.experts.down", *(p + moe.down for p in experts)]
    if not config.tie_word_embeddings and not config.is_classifier:  # (a classifier's `score` stays dense)
        names["lm_head"] = ["lm_head"]
    return names


def plan_formats(quant: QuantizationConfig, spec: ModelSpec, config: ModelConfig, in_features: dict[str, int]) -> dict[str, dict]:
    """Format spec of every linear: dense where ignored, else the method's format with per-module overrides."""
    dense = DenseFormat(getattr(torch, config.dtype)).spec()
    plan = {}
    all_names = module_names(spec, config)
    if quant.method != "none":
        _check_patterns(quant, all_names, config)
    ignored = []
    for module, names in all_names.items():
        if quant.method == "none" or _matches_all_or_none(quant.ignore, names, module):
            plan[module] = dense
            ignored.append(module)
        elif quant.method == "fp8" and quant.weights == "block":
            plan[module] = {"format": "w8a8-fp8-block", "block_size": [128, 128]}
        elif quant.method == "fp8":
            plan[module] = {"format": "w8a8-fp8", "is_per_channel": quant.weights == "per_channel",
                            "is_static_input": quant.activations == "static"}
        elif quant.method == "int8":
            plan[module] = {"format": "w8a8-int8"}
        else:
            plan[module] = _int_format(quant, names, module, in_features[module])
    if quant.method not in ("none", "fp8", "int8"):
        _check_overrides_reach(quant, all_names, ignored)
    return plan


def _check_overrides_reach(quant: QuantizationConfig, names: dict[str, list[str]], ignored: list[str]) -> None:
    """An override that names only linears `ignore` keeps dense changes nothing: refused (lm_head is in
    the default ignore list, so an override of it alone needs `ignore` without it)."""
    for i, override in enumerate(quant.overrides):
        hit = [module for module, module_names_ in names.items() if _matches(override.match, module_names_)]
        if hit and all(module in ignored for module in hit):
            raise RecipeError(f"quantization.overrides[{i}].match: {override.match!r} names only linears that "
                              f"quantization.ignore keeps unquantized ({', '.join(hit[:3])}"
                              f"{', ...' if len(hit) > 3 else ''}; ignore is {quant.ignore}); drop them from "
                              "ignore to quantize them, or drop the override")


def kernel_layout(spec: dict, device: str, is_expert: bool = False) -> dict:
    """The packing the target's kernel reads: on CUDA, 4-bit weights go into the layout of the Triton
    W4A16 GEMM ("gpu", kernels/w4a16_gemm.py; act-order groups permuted into place), except act-order
    experts (the fused MoE kernel reads no permutation); everything else keeps its plain layout."""
    is_w4 = spec["format"] == "w4a16" and not (is_expert and spec.get("has_g_idx"))
    return {**spec, "layout": "gpu"} if device == "cuda" and is_w4 else spec


def _check_patterns(quant: QuantizationConfig, names: dict[str, list[str]], config: ModelConfig) -> None:
    """Every ignore and override pattern names some linear (a typo quantized what it meant to keep, or
    kept what it meant to change); a tied lm_head (the embedding's matrix) says it stays unquantized."""
    known = [n for module_names_ in names.values() for n in module_names_] + ["lm_head"]
    patterns = [(f"quantization.ignore[{i}]", p) for i, p in enumerate(quant.ignore)]
    patterns += [(f"quantization.overrides[{i}].match", o.match) for i, o in enumerate(quant.overrides)]
    for key, pattern in patterns:
        if not _matches(pattern, known):
            raise RecipeError(f"{key}: {pattern!r} matches no linear of this model (names such as {known[0]!r}, "
                              f"{known[1]!r} or 'lm_head'); fix the pattern or drop it")
    if config.tie_word_embeddings and not any(_matches(p, ["lm_head"]) for p in quant.ignore):
        logger.info("lm_head is tied to the embedding (tie_word_embeddings) and stays %s: it is not quantized",
                    config.dtype)


def _matches_all_or_none(patterns: list[str], names: list[str], module: str, key: str = "quantization.ignore") -> bool:
    hits = [n for n in names[1:] or names if any(_matches(p, [n]) for p in patterns)]
    if any(_matches(p, names[:1]) for p in patterns):
        return True
    if hits and len(hits) != len(names[1:] or names):
        what = "ignore" if key == "quantization.ignore" else "change"
        raise RecipeError(f"{key} matches {hits} but they are fused into {module}; {what} all of them or none")
    return bool(hits)


def _int_format(quant: QuantizationConfig, names: list[str], module: str, in_features: int) -> dict:
    bits, group_size, symmetric = quant.bits, quant.group_size, quant.symmetric
    group_key = "quantization.group_size"
    for i, override in enumerate(quant.overrides):
        if _matches_all_or_none([override.match], names, module, f"quantization.overrides[{i}].match"):
            bits = override.bits or bits
            group_size = override.group_size or group_size
            group_key = f"quantization.overrides[{i}].group_size" if override.group_size else group_key
            symmetric = symmetric if override.symmetric is None else override.symmetric
            break
    try:
        num_groups_of(in_features, group_size)
    except RecipeError:
        fit = next((g for g in (512, 256, 128, 64, 32, 16) if g < group_size and in_features % g == 0), -1)
        raise RecipeError(f"{group_key}: {group_size} does not divide {module}'s {in_features} input features; "
                          "choose a group size that does, or -1 (per channel), or give this linear its own: "
                          f"quantization.overrides: [{{match: \"{module}\", group_size: {fit}}}]") from None
    return {"format": f"w{bits}a16", "bits": bits, "group_size": group_size, "symmetric": symmetric, "has_g_idx": False}


def linear_in_features(spec: ModelSpec, config: ModelConfig) -> dict[str, int]:
    q_size = config.num_heads * config.head_dim
    sizes = {"attn.qkv": config.hidden_size, "attn.o": q_size, "mlp.gate_up": config.hidden_size,
             "mlp.up": config.hidden_size, "mlp.down": config.intermediate_size,
             "moe.experts.gate_up": config.hidden_size,
             "moe.experts.down": config.moe_intermediate_size, "moe.shared.gate_up": config.hidden_size,
             "moe.shared.up": config.hidden_size,
             "moe.shared.down": config.shared_expert_intermediate_size}
    if config.is_mla:  # DeepSeek's attention (runtime/models/mla.py)
        sizes |= {"attn.q": config.hidden_size, "attn.q_a": config.hidden_size, "attn.q_b": config.q_lora_rank,
                  "attn.kv_a": config.hidden_size, "attn.kv_b": config.kv_lora_rank,
                  "attn.o": config.num_heads * config.v_head_dim}
    if config.linear_attention_layers:  # a Gated DeltaNet's (Qwen3.5)
        sizes |= {"attn.in_qkvz": config.hidden_size,
                  "attn.out": config.linear_num_value_heads * config.linear_value_head_dim}
    if config.mamba_layers:  # a Mamba-2 mixer's (Granite 4.0)
        sizes |= {"attn.mamba_in": config.hidden_size,
                  "attn.mamba_out": config.mamba_num_heads * config.mamba_head_dim}
    if config.short_conv_layers:  # a short conv's (LFM2)
        sizes |= {"attn.conv_in": config.hidden_size, "attn.conv_out": config.hidden_size}
    result = {f"layers.{i}.{name}": sizes[name] for i in range(config.num_layers) for name in config.layer_linears(i)}
    return result | {"lm_head": config.hidden_size}


# ---- quantizing one linear ------------------------------------------------------------------------


INT8_WEIGHTS = {"bits": 8, "group_size": -1, "symmetric": True}  # w8a8-int8's weights, as the int algorithms see them


def int_weight_params(fmt_spec: dict) -> dict:
    """bits, group_size, symmetric of an integer format's weights (w8a8-int8: 8, per channel, symmetric)."""
    if fmt_spec["format"] == "w8a8-int8":
        return INT8_WEIGHTS
    return {key: fmt_spec[key] for key in ("bits", "group_size", "symmetric")}


def uses_gptq(quant: QuantizationConfig) -> bool:
    """Whether the recipe's weights are rounded by GPTQ: method gptq, or method int8 with algorithm gptq."""
    return quant.method == "gptq" or (quant.method == "int8" and quant.algorithm == "gptq")


def quantize_rtn(weight: Tensor, fmt_spec: dict, scale_dtype: torch.dtype, clip_ratio=None) -> QuantizedWeight:
    if fmt_spec["format"] == "w8a8-fp8":
        return quantize_fp8_weight(weight, fmt_spec["is_per_channel"])
    if fmt_spec["format"] == "w8a8-fp8-block":
        return quantize_fp8_weight_block(weight, tuple(fmt_spec["block_size"]))
    p = int_weight_params(fmt_spec)
    return rtn_quantize(weight, p["bits"], p["group_size"], p["symmetric"], clip_ratio=clip_ratio,
                        scale_dtype=scale_dtype)


class LayerQuantizer:
    """Quantizes one layer's linears in place of the float ones; `method` is the recipe's."""

    def __init__(self, quant: QuantizationConfig, formats: dict[str, dict], config: ModelConfig,
                 runner: LayerRunner | None, tail=None):
        """tail: the float rest of the model (pipeline.ModelTail) by whose loss AWQ chooses a layer's
        variant; None: by the layer's output error."""
        self.quant = quant
        self.tail = tail
        self.formats = formats
        self.config = config
        self.runner = runner
        self.scale_dtype = getattr(torch, config.dtype)
        # MoE: experts quantized by round-to-nearest for lack of routed calibration tokens:
        # "layers.3.moe.experts.5.down" → the tokens it had (compiler/moe_calibration.py)
        self.expert_fallbacks: dict[str, int] = {}

    def record_fallback(self, index: int, name: str, num_tokens: int) -> None:
        self.expert_fallbacks[f"layers.{index}.{name}"] = num_tokens

    def rtn(self, weight: Tensor, spec: dict) -> QuantizedWeight:
        return quantize_rtn(weight, spec, self.scale_dtype)

    def quantize(self, layer: LayerWeights, hidden: Tensor | None,
                 hidden_float: Tensor | None = None) -> dict[str, QuantizedWeight | None]:
        """Quantized weight per linear name (None = stays dense). Leaves the dequantized weights in
        `layer` (the next layer's inputs are computed with them); AWQ also rewrites its norms.
        hidden: calibration hidden states through the quantized layers before; hidden_float: the same
        windows through the float model, given for GPTQ's float targets."""
        method = self.quant.method
        if method == "int8" and self.quant.smoothquant:
            smooth_layer(layer, self._smoothquant_ranges(layer, hidden), self.quant.smoothquant)
        if uses_gptq(self.quant):
            return self._gptq(layer, hidden, hidden_float)
        if method == "awq":
            return self._awq(layer, hidden)
        input_scales = self._fp8_input_scales(layer, hidden) if method == "fp8" and self.quant.activations == "static" else {}
        result = {}
        for name, w in layer.linears.items():
            spec = self._spec(layer, name)
            if spec["format"] == "dense":
                result[name] = None
                continue
            result[name] = quantize_rtn(w, spec, self.scale_dtype)
            result[name].input_scale = input_scales.get(name)
            layer.linears[name] = dequantize_weight(result[name])
        return result

    def _spec(self, layer: LayerWeights, name: str) -> dict:
        return self.formats[f"layers.{layer.index}.{format_key(name)}"]

    def _gptq(self, layer: LayerWeights, hidden: Tensor, hidden_float: Tensor | None) -> dict:
        result = {}
        # With float targets: the layer as it was before any of its linears was quantized, built once.
        float_module = None if hidden_float is None else self.runner.build_layer(
            LayerWeights(layer.index, dict(layer.linears), dict(layer.biases), dict(layer.norms)))
        for names in linear_groups(layer).values():  # in order: each sees its quantized predecessors' outputs
            if self._spec(layer, names[0])["format"] == "dense":
                result |= {name: None for name in names}
            elif is_expert_group(names):  # all experts of one projection at once (compiler/moe_calibration.py)
                result |= gptq_experts(self, layer, names, hidden)
            else:
                result[names[0]] = self._gptq_linear(layer, names[0], hidden, float_module, hidden_float)
        return result

    def _gptq_linear(self, layer: LayerWeights, name: str, hidden: Tensor, float_module, hidden_float) -> QuantizedWeight:
        q = self.gptq(layer.linears[name], self._hessian(layer, name, hidden, float_module, hidden_float),
                      self._spec(layer, name))
        layer.linears[name] = dequantize_weight(q)
        return q

    def gptq(self, weight: Tensor, acc: HessianAccumulator, spec: dict) -> QuantizedWeight:
        """GPTQ of one weight on the inputs `acc` accumulated (with float targets, their drift folded into
        the weight first), on the CPU; also the quantized lm_head's (pipeline.QuantizingPacker)."""
        if acc.drift is not None:
            weight = float_target_weight(weight, acc.hessian, acc.drift, self.quant.damp_percent)
        p = int_weight_params(spec)
        q = gptq_quantize(weight.to(self.runner.device), acc.hessian, p["bits"], p["group_size"],
                          p["symmetric"], act_order=self.quant.act_order, damp_percent=self.quant.damp_percent,
                          scale_dtype=self.scale_dtype)
        return _to_cpu(q)

    def _hessian(self, layer: LayerWeights, name: str, hidden: Tensor, float_module: DecoderLayer | None = None,
                 hidden_float: Tensor | None = None) -> HessianAccumulator:
        """H = 2XᵀX/n of the linear's inputs, from one forward of the layer as it is now; with
        hidden_float, also the drift from the float model: `float_module` run on `hidden_float`."""
        acc = HessianAccumulator(layer.linears[name].shape[1], self.runner.device, hidden_float is not None)
        module = self.runner.build_layer(layer)
        if hidden_float is not None:
            self.runner.capture_paired(module, hidden, float_module, hidden_float, [name],
                                       lambda _, x, x_float: acc.add_batch(x, x_float))
            return acc
        handles = capture_inputs(module, [name], lambda _, x: acc.add_batch(x))
        self.runner.forward(module, hidden)
        for handle in handles:
            handle.remove()
        return acc

    def _capture_all(self, layer: LayerWeights, hidden: Tensor, keep, names: list[str] | None = None) -> dict:
        """{linear name: [keep(x) per chunk of its inputs]} (an expert: of its routed inputs; none if it got none)."""
        names = list(layer.linears) if names is None else names
        store: dict[str, list] = {name: [] for name in names}
        module = self.runner.build_layer(layer)
        handles = capture_inputs(module, names, lambda n, x: store[n].append(keep(x)))
        self.runner.forward(module, hidden)
        for handle in handles:
            handle.remove()
        return store

    def _smoothquant_ranges(self, layer: LayerWeights, hidden: Tensor) -> dict[str, Tensor]:
        """{linear: [in] float32 per-channel max - min of its calibration inputs} for the linears SmoothQuant
        balances (qkv, gate_up), from one forward of the layer as it is (llm-compressor's observer on the norm's
        output: the dynamic range, max - min)."""
        names = [name for name, _ in SMOOTHQUANT_MAPPINGS]

        def keep(x: Tensor) -> tuple[Tensor, Tensor]:
            x = x.reshape(-1, x.shape[-1]).float()
            return x.amin(dim=0).cpu(), x.amax(dim=0).cpu()

        ranges = {}
        for name, chunks in self._capture_all(layer, hidden, keep, names).items():
            lo = torch.stack([c[0] for c in chunks]).amin(dim=0)
            hi = torch.stack([c[1] for c in chunks]).amax(dim=0)
            ranges[name] = hi - lo
        return ranges

    def _fp8_input_scales(self, layer: LayerWeights, hidden: Tensor) -> dict[str, Tensor]:
        observers = {name: AbsmaxObserver() for name in layer.linears}
        dense = [n for n in layer.linears if expert_of(n) is None]
        for name, xs in self._capture_all(layer, hidden, lambda x: x.abs().max().item(), dense).items():
            observers[name].absmax = max(xs)
        for names in linear_groups(layer).values():
            if is_expert_group(names):
                for name, absmax in expert_input_absmax(self, layer, names, hidden).items():
                    observers[name].absmax = absmax
        return {name: obs.input_scale() for name, obs in observers.items()}

    def _awq(self, layer: LayerWeights, hidden: Tensor) -> dict:
        _move_layer(layer, self.runner.device)  # the searches run where the calibration inputs are
        try:
            quantized = awq_quantize_layer(self, layer, hidden)
            return {name: None if q is None else _to_cpu(q) for name, q in quantized.items()}
        finally:
            _move_layer(layer, torch.device("cpu"))


# SmoothQuant's (linear, the norm that produces its input): llm-compressor's default mappings for Llama
# ([q, k, v] ← input_layernorm, [gate, up] ← post_attention_layernorm), q/k/v and gate/up fused here.
SMOOTHQUANT_MAPPINGS = (("attn.qkv", "input_norm"), ("mlp.gate_up", "post_attn_norm"))
MIN_SMOOTHING_SCALE = 1e-5  # llm-compressor's MINIMUM_SMOOTHING_SCALE


def smoothing_scales(input_range: Tensor, weight: Tensor, alpha: float) -> Tensor:
    """[in] float32 smoothing scales s of one linear, as llm-compressor's SmoothQuantModifier computes them:
    s_j = range_j^alpha / (2 max_o |W_oj|)^(1 - alpha), where range_j = max - min of input channel j over the
    calibration tokens (≈ 2 max|X_j|, so the ratio is SmoothQuant's max|X_j|^a / max|W_j|^(1-a) up to a constant
    2^(2a-1)); s_j = range_j where column j of W is zero; floored at 1e-5."""
    weight_max = 2.0 * weight.float().abs().amax(dim=0)  # [in]
    scales = input_range.float().pow(alpha) / weight_max.pow(1 - alpha)
    scales = torch.where(weight_max > 0, scales, input_range.float())
    return scales.clamp(min=MIN_SMOOTHING_SCALE)


def smooth_layer(layer: LayerWeights, input_ranges: dict[str, Tensor], alpha: float) -> dict[str, Tensor]:
    """SmoothQuant on one layer, in place: for each (linear, norm) of SMOOTHQUANT_MAPPINGS, the norm's weight
    divided by s and the linear's columns multiplied by s (x W^T = (x / s)(W s)^T: the same float function).
    Returns the scales by linear name."""
    applied = {}
    for name, norm in SMOOTHQUANT_MAPPINGS:
        if name not in layer.linears or norm not in layer.norms:
            raise RecipeError(f"quantization.smoothquant: layer {layer.index} has no {norm} before {name}; "
                              "SmoothQuant folds into the norm before qkv and gate_up (pre-norm decoders only); "
                              "set smoothquant: null")
        weight = layer.linears[name]
        s = smoothing_scales(input_ranges[name].to(weight.device), weight, alpha)
        layer.linears[name] = weight * s.to(weight.dtype)  # (the layer's weights are float32 at build time)
        norm_weight = layer.norms[norm]
        layer.norms[norm] = norm_weight / s.to(norm_weight.device, norm_weight.dtype)
        applied[name] = s
    return applied


def _move_layer(layer: LayerWeights, device: torch.device) -> None:
    for tensors in (layer.linears, layer.biases, layer.norms):
        for name in tensors:
            tensors[name] = tensors[name].to(device)


def _to_cpu(q: QuantizedWeight) -> QuantizedWeight:
    return QuantizedWeight(**{k: (v.cpu() if isinstance(v, Tensor) else v) for k, v in q.__dict__.items()})
