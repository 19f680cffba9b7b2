"""Per-layer FP8 KV-cache scales: measured on the calibration windows, or read from an imported
compressed-tensors checkpoint's `kv_cache_scheme` or a ModelOpt one's `kv_cache_quant_algo: FP8` (kv section of
the manifest, runtime/kv_cache.py).

scale = amax / FP8 max (448 for e4m3, 57344 for e5m2), per layer for K and for V over every token
and head, as vLLM and llm-compressor's per-tensor kv_cache_scheme keep them: the largest key or value
the calibration text produced lands on the largest FP8 value, and anything larger saturates.
K is measured after the k-norm and the rotary embedding: what the runtime writes to the cache.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from llmc.compiler.calibration import LayerRunner
from llmc.compiler.convert import LayerWeights
from llmc.compiler.hf_checkpoint import TensorReader
from llmc.compiler.import_quantized import checkpoint_quantization_config
from llmc.errors import CheckpointError
from llmc.quant.import_config import modelopt_fields
from llmc.runtime import artifact as art
from llmc.runtime.models.spec import ModelSpec

logger = logging.getLogger("llmc")


@dataclass(frozen=True)
class KVScales:
    """kv section fields: k_scales and v_scales per decoder layer, and where they came from."""

    k_scales: list[float]
    v_scales: list[float]
    source: str  # "calibration" | "checkpoint"


def fp8_max(kv_cache_dtype: str) -> float:
    """The largest finite value of the FP8 dtype runtime.kv_cache_dtype names (e4m3 for auto)."""
    return torch.finfo(getattr(torch, art.KV_CACHE_DTYPES[kv_cache_dtype] or "float8_e4m3fn")).max


def scale_from_amax(amax: float, max_value: float) -> float:
    """amax / max_value; 1.0 for a tensor that is all zeros (any scale stores it exactly)."""
    return amax / max_value if amax > 0 else 1.0


class KVScaleObserver:
    """A LayerPacker wrapper: hands each layer to `packer` unchanged, and runs the layer's float
    weights over the calibration hidden states (carried from layer to layer, in float32), recording
    the amax of the K and V it writes to the cache."""

    def __init__(self, packer, runner: LayerRunner, hidden: Tensor, max_value: float):
        self.packer, self.runner, self.hidden, self.max_value = packer, runner, hidden, max_value
        self.k_amax: list[float] = []
        self.v_amax: list[float] = []
        if hasattr(packer, "read_layer"):
            self.read_layer = packer.read_layer
        if hasattr(packer, "read_global"):
            self.read_global = packer.read_global
        if hasattr(packer, "report"):
            self.report = packer.report

    def __call__(self, layer: LayerWeights) -> LayerWeights:
        float_layer = LayerWeights(layer.index, dict(layer.linears), dict(layer.biases), dict(layer.norms))
        packed = self.packer(layer)
        amax = [0.0, 0.0]

        def observe(k_cache: Tensor, v_cache: Tensor | None = None) -> None:
            """K and V; or MLA's one latent cache, whose amax is both (runtime/models/mla.py reads k_scale)."""
            amax[0] = max(amax[0], float(k_cache.abs().max()))
            amax[1] = max(amax[1], float((k_cache if v_cache is None else v_cache).abs().max()))

        self.hidden = self.runner.forward(self.runner.build_layer(float_layer), self.hidden, observe_kv=observe)
        self.k_amax.append(amax[0])
        self.v_amax.append(amax[1])
        return packed

    def pack_global(self, module: str, weight: Tensor):
        return self.packer.pack_global(module, weight) if hasattr(self.packer, "pack_global") else weight

    def scales(self) -> KVScales:
        return KVScales([scale_from_amax(a, self.max_value) for a in self.k_amax],
                        [scale_from_amax(a, self.max_value) for a in self.v_amax], "calibration")


def checkpoint_kv_scales(hf_config: dict, reader: TensorReader, spec: ModelSpec, num_layers: int) -> KVScales | None:
    """The per-layer k_scale / v_scale tensors an imported checkpoint carries; None without KV quantization.
    compressed-tensors' kv_cache_scheme: `model.layers.N.self_attn.k_scale`, or as older exports named it
    `...self_attn.k_proj.output_scale`, which vLLM reads too. ModelOpt's kv_cache_quant_algo FP8:
    `...self_attn.k_proj.k_scale` and `...v_proj.v_scale` (its amax / 448, which ModelOpt raises to at least 1), or
    `self_attn.k_scale`. Both are vLLM's per-tensor dequantization factors of the post-rotary K and of V, as llmc's
    are. A per-head scale is reduced to its maximum (llmc keeps one scale per layer): no head's values then saturate."""
    qc = checkpoint_quantization_config(hf_config, reader.model_dir) or {}
    if str(qc.get("quant_method", "")).lower().startswith("modelopt"):
        if modelopt_fields(qc)[1] is None:  # (parse_quantization_config refused any kv_cache_quant_algo but FP8)
            return None
        what, names = "kv_cache_quant_algo FP8", ("self_attn.{kind}_proj.{kind}_scale", "self_attn.{kind}_scale")
    else:
        scheme = qc.get("kv_cache_scheme")
        if not scheme:
            return None
        if scheme.get("type", "float") != "float" or scheme.get("num_bits", 8) != 8:
            raise CheckpointError(f"{reader.model_dir}: kv_cache_scheme {scheme} is not FP8 (8-bit float); "
                                  "llmc imports FP8 KV scales only")
        # (older: llm-compressor before 0.3)
        what, names = "kv_cache_scheme", ("self_attn.{kind}_scale", "self_attn.{kind}_proj.output_scale")
    scales: dict[str, list[float]] = {"k": [], "v": []}
    for i in range(num_layers):
        for kind in scales:
            candidates = [f"{spec.hf_layer_prefix}{i}.{n.format(kind=kind)}" for n in names]
            name = next((n for n in candidates if reader.has(n)), None)
            if name is None:
                raise CheckpointError(f"{reader.model_dir}: the checkpoint's quantization config has a {what} but the "
                                      f"weights lack {candidates[0]}; re-export the checkpoint with its KV scales")
            value = float(reader.get(name).float().max())
            if not (value > 0 and value != float("inf")):
                raise CheckpointError(f"{reader.model_dir}: {name} is {value}, not a finite scale > 0")
            scales[kind].append(value)
    return KVScales(scales["k"], scales["v"], "checkpoint")
