"""AWQ on one decoder layer, the variant chosen by the loss the rest of the model reaches.

NOTE (algorithm): the inputs of every linear are captured once from the float layer. Each AWQ
variant then scales, folds and quantizes a copy of the layer. Within a variant, each linear's scale
search minimises that linear's output error (`quant/awq.py`). The variant kept is the one with the
lowest next-token loss on calibration windows the searches did not see, when its output runs through
the float layers after it, the final norm and lm_head (`pipeline.ModelTail`). Plain round-to-nearest
is always a candidate, so on those windows the result is never worse than round-to-nearest.
Without a tail (a layer quantized on its own) the variants are compared by the MSE of the layer's
output against the float layer's instead.

Why the model's loss: per channel at 4 bits every variant changed a layer's output error by only
1-3%, and choosing by that error gave 50.41 on heldout.txt against 50.33 for round-to-nearest;
choosing by the loss gave 50.28, lower on 6 of the 7 sources (benchmarks/RESULTS.md). The cost is
running layers i+1.. once more per variant for every layer i.

The variants depend on the bits. At 4 bits and more: the scale search alone. Below 4 bits also
duo scaling (scales from weight magnitudes too) and the per-group clipping search, each on or off.
Measured on ref-llama-12m (W4 g128 asymmetric, heldout.txt): clipping and duo scaling lowered the
layer-output error on calibration text by up to 23% but raised perplexity on unseen text
(50.32-50.51 against 50.05 for the scale search alone and 50.20 for round-to-nearest); at 3 bits
clipping is what beats the peer (52.16-52.24 against 52.71 without it).
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

from llmc.compiler.convert import LayerWeights
from llmc.compiler.moe_calibration import expert_token_count, scale_router, stack_inputs
from llmc.quant.awq import awq_search_clip, awq_search_scale, weight_magnitude
from llmc.quant.formats import QuantizedWeight
from llmc.quant.reference import dequantize_weight
from llmc.quant.rtn import fake_quantize, rtn_quantize
from llmc.runtime.artifact import ModelConfig
from llmc.runtime.models.spec import expert_of

AWQ_MAX_TOKENS = 8192  # calibration tokens kept per linear for the searches
NUM_SELECTION_WINDOWS = 32  # calibration windows the variants are compared on


def awq_quantize_layer(quantizer, layer: LayerWeights, hidden: Tensor) -> dict[str, QuantizedWeight | None]:
    """Quantize `layer` in place (weights, folded norms) with the best AWQ variant; returns its weights."""
    runner = quantizer.runner
    # The variants are compared on windows their searches did not see, so the choice is not an overfit.
    num_select = min(NUM_SELECTION_WINDOWS, hidden.shape[0] // 4) or 1
    search, windows = (hidden[:-num_select], hidden[-num_select:]) if hidden.shape[0] > 1 else (hidden, hidden)
    stride = max(1, search.shape[0] * search.shape[1] // AWQ_MAX_TOKENS)
    captured = quantizer._capture_all(layer, search, lambda x: x[::stride].float())
    inputs = {n: torch.cat(xs) for n, xs in captured.items() if xs}  # an expert no token reached has none
    candidates = []  # (trial layer, its quantized weights, its output on the selection windows)
    for variant in _variants(quantizer, layer):
        trial = LayerWeights(layer.index, dict(layer.linears), dict(layer.biases), dict(layer.norms))
        quantized = _quantize_variant(quantizer, trial, inputs, variant)
        candidates.append((trial, quantized, runner.forward(runner.build_layer(trial), windows)))
    outputs = [output for _, _, output in candidates]
    if quantizer.tail is not None:
        selection = slice(hidden.shape[0] - num_select, None) if hidden.shape[0] > 1 else slice(None)
        errors = quantizer.tail.losses(layer.index, outputs, selection)
    else:
        target = runner.forward(runner.build_layer(layer), windows)
        errors = [(output - target).pow(2).mean().item() for output in outputs]
    trial, quantized, _ = candidates[errors.index(min(errors))]  # ties: the first, round to nearest
    layer.linears, layer.biases, layer.norms = trial.linears, trial.biases, trial.norms
    return quantized


def _variants(quantizer, layer: LayerWeights) -> list:
    """None (round to nearest), then (duo_scaling, clip) pairs: see the module docstring for why."""
    specs = [quantizer._spec(layer, name) for name in layer.linears]
    if min((spec["bits"] for spec in specs if spec["format"] != "dense"), default=4) >= 4:
        return [None, (False, False)]
    return [None, *itertools.product((True, False), (True, False))]


def _quantize_variant(quantizer, layer: LayerWeights, inputs: dict, variant) -> dict:
    """variant None: round to nearest; else (duo_scaling, clip). Leaves dequantized weights in `layer`."""
    scales = {}
    if variant is not None:
        duo_scaling, _ = variant
        for name, target in _awq_folds(quantizer.config, layer):
            spec = quantizer._spec(layer, name)
            if spec["format"] == "dense" or (name in layer.linears and not _has_enough_tokens(quantizer, layer, inputs, name)):
                continue
            # an MoE's gate_up: every expert's, with one shared scale (Cohere's qkv and gate_up, MLA's q and kv_a too)
            members = _fold_members(layer, name, quantizer.config)
            x = inputs[name] if name in inputs else stack_inputs(inputs, members)
            weights = [layer.linears[m] for m in members]
            w_mean = weight_magnitude(weights, spec["group_size"]) if duo_scaling else None
            found = awq_search_scale(x, weights, _fake_quantizer(quantizer, spec), w_mean=w_mean)
            for i, member in enumerate(members):  # the producer (norm) divided once for all members
                scales[member] = found.scales
                _fold(layer, member, target, found.scales, divides_producer=i == 0, config=quantizer.config)
            if name == "moe.experts.gate_up":
                scale_router(layer, found.scales)
    is_clipped = variant is not None and variant[1]
    return {name: _quantize_linear(quantizer, layer, name, _scaled_inputs(inputs, name, scales), is_clipped)
            for name in layer.linears}


def _has_enough_tokens(quantizer, layer: LayerWeights, inputs: dict, name: str) -> bool:
    """An expert's own scale search needs routed tokens; under min_expert_tokens it is left unscaled (RTN)."""
    if expert_of(name) is None:
        return True
    num_tokens = expert_token_count(inputs, name)
    if num_tokens < quantizer.quant.min_expert_tokens:
        quantizer.record_fallback(layer.index, name, num_tokens)
        return False
    return True


def _fold_members(layer: LayerWeights, name: str, config: ModelConfig) -> list[str]:
    """The linears one scale folds into: an MoE's gate_up, every expert's and the shared expert's (they read the
    same norm's output); in a parallel block (Cohere) qkv and gate_up (both read input_norm's)."""
    if name == "attn.qkv" and config.parallel_block:
        return [name, "mlp.gate_up"]
    if name == "moe.experts.gate_up":
        shared = ["moe.shared.gate_up"] if "moe.shared.gate_up" in layer.linears else []
        return [n for n in layer.linears if expert_of(n) is not None and n.endswith(".gate_up")] + shared
    if name == "attn.kv_a":  # MLA: q (or q_a) reads input_norm's output too
        return [n for n in ("attn.q", "attn.q_a") if n in layer.linears] + [name]
    return [name]


def _scaled_inputs(inputs: dict, name: str, scales: dict) -> Tensor | None:
    return inputs[name] / scales.get(name, 1.0) if name in inputs else None


def _fake_quantizer(quantizer, spec: dict):
    return lambda w, clip_ratio=None: fake_quantize(w, spec["bits"], spec["group_size"], spec["symmetric"],
                                                    clip_ratio=clip_ratio, scale_dtype=quantizer.scale_dtype)


def _quantize_linear(quantizer, layer: LayerWeights, name: str, x: Tensor | None, is_clipped: bool) -> QuantizedWeight | None:
    spec = quantizer._spec(layer, name)
    if spec["format"] == "dense":
        return None
    w = layer.linears[name]
    clip = None
    if is_clipped and x is not None and x.shape[0] >= quantizer.quant.min_expert_tokens:
        clip = awq_search_clip(x, w, _fake_quantizer(quantizer, spec), spec["group_size"])
        if name == "attn.qkv":  # q and k rows feed a softmax: clipping them hurts more than it helps
            config = quantizer.config
            clip[: (config.num_heads + config.num_kv_heads) * config.head_dim] = 1.0
        elif name in ("attn.q", "attn.q_b", "attn.kv_a"):  # MLA: q, and the rope key (kv_a's latent feeds kv_b)
            clip[:] = 1.0
        elif name == "attn.kv_b":  # MLA: each head's k_nope rows
            clip[_mla_rows(quantizer.config, "k")] = 1.0
    q = rtn_quantize(w, spec["bits"], spec["group_size"], spec["symmetric"], clip_ratio=clip,
                     scale_dtype=quantizer.scale_dtype)
    layer.linears[name] = dequantize_weight(q)
    return q


def _awq_folds(config: ModelConfig, layer: LayerWeights | None = None) -> list[tuple[str, str]]:
    """(linear, where its input scale folds): a norm, or the preceding linear's output rows. Without pre-norms
    (OLMo 2) qkv and gate_up have no such producer and are not scaled (round to nearest, or clipped below 4 bits).
    In a parallel block (Cohere) qkv and gate_up read one norm: one scale, searched over both, folds into it.

    An MoE layer (as llm-compressor maps Mixtral): every expert's gate_up shares one scale folded into
    post_attn_norm (the router's columns take it back), searched on the tokens as they reach the
    experts; each expert's down gets its own, from its routed tokens, folded into its up rows (not gpt-oss's, whose
    clamped SwiGLU is not linear in up: its experts' down is not scaled). A shared expert's gate_up takes the experts'
    scale (it reads the same norm), its down its own, folded into its up rows.

    DeepSeek's latent attention: q (or q_a) and kv_a share one scale folded into input_norm, q_b's folds into
    q_a_norm, kv_b's into kv_a_norm, and o's into kv_b's v rows (each head's), as o's into qkv's v rows."""
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    attention = [("attn.qkv", "input_norm")] + ([("attn.o", "attn.qkv")] if q_size == kv_size else [])
    if config.is_mla:  # DeepSeek: q (or q_a) and kv_a share input_norm's scale (_fold_members); q_b's folds into
        # q_a_norm, kv_b's into kv_a_norm, o's into kv_b's v rows
        attention = [("attn.kv_a", "input_norm"), *([("attn.q_b", "attn.q_a_norm")] if config.q_lora_rank else []),
                     ("attn.kv_b", "attn.kv_a_norm"), ("attn.o", "attn.kv_b")]
    if layer is not None and config.is_moe_layer(layer.index):
        # gpt-oss: down's input, (clamp(up) + 1) * glu, is not linear in up's rows: no fold for its experts' down
        downs = [n for n in layer.linears if expert_of(n) is not None and n.endswith(".down")
                 and config.swiglu_limit is None]
        mlp = [("moe.experts.gate_up", "post_attn_norm"), *((n, n.replace(".down", ".gate_up")) for n in downs)]
        if "moe.shared.down" in layer.linears:  # the shared expert's down, its scale folded into its own up rows
            mlp.append(("moe.shared.down", "moe.shared.gate_up"))
    else:
        mlp = [("mlp.gate_up", "post_attn_norm"), ("mlp.down", "mlp.gate_up")]
    if config.parallel_block:  # Cohere: gate_up takes qkv's scale (_fold_members), both folded into input_norm
        mlp = [("mlp.down", "mlp.gate_up")]
    folds = [*attention, *mlp]  # (o's inputs are v's outputs only without grouped-query attention)
    if not config.pre_norms:  # OLMo 2: qkv and gate_up read the residual stream, with no norm to take a scale
        folds = [(name, target) for name, target in folds if target not in ("input_norm", "post_attn_norm")]
    return folds


def _mla_rows(config: ModelConfig, part: str) -> Tensor:
    """The rows of MLA's kv_b holding each head's k_nope ("k") or v ("v"), head by head."""
    width, offset, size = config.qk_nope_head_dim + config.v_head_dim, *(
        (0, config.qk_nope_head_dim) if part == "k" else (config.qk_nope_head_dim, config.v_head_dim))
    return (torch.arange(config.num_heads)[:, None] * width + offset + torch.arange(size)).flatten()


def _fold(layer: LayerWeights, name: str, target: str, s: Tensor, divides_producer: bool = True,
          config: ModelConfig | None = None) -> None:
    """W_name[:, j] *= s_j and the producer of input j divides by s_j: the layer's function is unchanged. Linears that
    share one producer (an MoE's experts' gate_up, MLA's q and kv_a) each take s, the producer divides once
    (divides_producer)."""
    layer.linears[name] = layer.linears[name] * s
    if not divides_producer:
        return
    if target in layer.norms:
        layer.norms[target] = layer.norms[target] / s
        return
    rows = slice(layer.linears[target].shape[0] - s.shape[0], None)  # v is the tail of qkv, up of gate_up
    if target == "attn.kv_b":  # MLA: o's inputs are each head's v rows of kv_b
        rows = _mla_rows(config, "v")
    producer = layer.linears[target].clone()
    producer[rows] /= s.unsqueeze(1)
    layer.linears[target] = producer
    if target in layer.biases:
        bias = layer.biases[target].clone()
        bias[rows] /= s
        layer.biases[target] = bias
