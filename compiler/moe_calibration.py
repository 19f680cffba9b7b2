"""Calibrating the experts of an MoE layer, each on the calibration tokens routed to it.

NOTE (algorithm): an expert's linears only ever see the tokens the router sends them, so their
statistics are gathered from those tokens alone (runtime/models/moe.py reports each expert's routed
inputs to the compiler's observers). One layer forward captures every expert of a projection at
once: GPTQ quantizes all experts' gate_up from their Hessians, then, with those in place, all
experts' down; FP8 static takes each expert's own input absmax. An expert routed fewer than
`quantization.min_expert_tokens` tokens has too little data for a Hessian or a scale: it falls back
to round-to-nearest (FP8 static: the largest input scale of the layer's other experts of that
projection) and the build report lists it, as llm-compressor does for experts that see too few
tokens. GPTQ's float targets are not used for experts: the float model routes tokens differently,
so there are no paired inputs to fit against. The router is never quantized.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmc.compiler.calibration import capture_inputs
from llmc.compiler.convert import LayerWeights
from llmc.quant.formats import QuantizedWeight
from llmc.quant.gptq import HessianAccumulator, gptq_quantize
from llmc.quant.reference import dequantize_weight
from llmc.runtime.models.spec import expert_of, format_key


def linear_groups(layer: LayerWeights) -> dict[str, list[str]]:
    """The layer's linears by format key, in order: "attn.qkv" → ["attn.qkv"], ...,
    "moe.experts.gate_up" → ["moe.experts.0.gate_up", ...]."""
    groups: dict[str, list[str]] = {}
    for name in layer.linears:
        groups.setdefault(format_key(name), []).append(name)
    return groups


def is_expert_group(names: list[str]) -> bool:
    return expert_of(names[0]) is not None


def capture_expert_inputs(quantizer, layer: LayerWeights, names: list[str], hidden: Tensor, observe) -> None:
    """One forward of the layer as it is now, calling observe(name, x [n, in]) with each expert's routed inputs."""
    module = quantizer.runner.build_layer(layer)
    handles = capture_inputs(module, names, observe)
    quantizer.runner.forward(module, hidden)
    for handle in handles:
        handle.remove()


def gptq_experts(quantizer, layer: LayerWeights, names: list[str], hidden: Tensor) -> dict[str, QuantizedWeight]:
    """GPTQ for every expert of one projection, each from the Hessian of its own routed tokens;
    RTN for those under the token threshold (recorded in quantizer.expert_fallbacks)."""
    device = quantizer.runner.device
    accs = {name: HessianAccumulator(layer.linears[name].shape[1], device) for name in names}
    capture_expert_inputs(quantizer, layer, names, hidden, lambda name, x: accs[name].add_batch(x))
    quant, result = quantizer.quant, {}
    for name in names:
        spec = quantizer._spec(layer, name)
        if accs[name].num_samples < quant.min_expert_tokens:
            quantizer.record_fallback(layer.index, name, accs[name].num_samples)
            result[name] = quantizer.rtn(layer.linears[name], spec)
        else:
            q = gptq_quantize(layer.linears[name].to(device), accs[name].hessian, spec["bits"], spec["group_size"],
                              spec["symmetric"], act_order=quant.act_order, damp_percent=quant.damp_percent,
                              scale_dtype=quantizer.scale_dtype)
            result[name] = QuantizedWeight(**{k: (v.cpu() if isinstance(v, Tensor) else v) for k, v in q.__dict__.items()})
        layer.linears[name] = dequantize_weight(result[name])
    return result


def expert_input_absmax(quantizer, layer: LayerWeights, names: list[str], hidden: Tensor) -> dict[str, float]:
    """FP8 static: absmax of each expert's routed inputs; an expert under the token threshold takes the
    largest of its projection's other experts (recorded as a fallback)."""
    absmax = {name: 0.0 for name in names}
    counts = {name: 0 for name in names}

    def observe(name: str, x: Tensor) -> None:
        absmax[name] = max(absmax[name], x.abs().max().item())
        counts[name] += x.shape[0]

    capture_expert_inputs(quantizer, layer, names, hidden, observe)
    calibrated = [absmax[n] for n in names if counts[n] >= quantizer.quant.min_expert_tokens]
    shared = max(calibrated, default=max(absmax.values()))
    for name in names:
        if counts[name] < quantizer.quant.min_expert_tokens:
            quantizer.record_fallback(layer.index, name, counts[name])
            absmax[name] = shared
    return absmax


def expert_token_count(inputs: dict[str, Tensor], name: str) -> int:
    x = inputs.get(name)
    return 0 if x is None else int(x.shape[0])


def scale_router(layer: LayerWeights, s: Tensor) -> None:
    """The router (and Qwen2-MoE's shared expert gate) reads the same normed input as the experts' gate_up: when
    AWQ folds 1/s into that norm, their columns take s back, so their logits are unchanged."""
    for name in ("moe.gate", "moe.shared_gate"):
        if name in layer.norms:
            layer.norms[name] = layer.norms[name] * s.to(layer.norms[name].device)


def stack_inputs(inputs: dict[str, Tensor], names: list[str]) -> Tensor:
    """Every expert's routed inputs of one projection, as one [n, in] batch (a token counted once per expert it reaches)."""
    return torch.cat([inputs[name] for name in names if name in inputs])
