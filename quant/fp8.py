"""FP8 (E4M3) quantization for the `w8a8-fp8` format: weights per channel or per tensor, activation scales.

scale = absmax / 448 (E4M3's largest finite value), fp8 = saturate(value / scale): the convention of
compressed-tensors' float-quantized checkpoints and vLLM, so imported FP8 weights need no rescaling.
Activations are quantized per token at run time (`quantize_fp8_per_token`) or, for static input
scales, with `input_scale_from_absmax` of the calibration inputs (`AbsmaxObserver`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmc.quant.formats import QuantizedWeight
from llmc.quant.numerics import (
    FP8_E4M3_MAX,
    absmax_to_scale,
    cast_to_fp8,
    quantize_fp8_per_token,
    quantize_fp8_static,
)

__all__ = [
    "FP8_E4M3_MAX",
    "AbsmaxObserver",
    "input_scale_from_absmax",
    "quantize_fp8_per_token",
    "quantize_fp8_static",
    "quantize_fp8_weight",
]


def quantize_fp8_weight(
    weight: Tensor, is_per_channel: bool = True, input_scale: Tensor | None = None
) -> QuantizedWeight:
    """weight [out, in] → E4M3 levels with scales [out, 1] (per channel) or [1, 1] (per tensor)."""
    absmax = weight.abs().float()
    absmax = absmax.amax(dim=1, keepdim=True) if is_per_channel else absmax.amax().reshape(1, 1)
    scales = absmax_to_scale(absmax)  # [out, 1] | [1, 1]
    return QuantizedWeight(
        qweight=cast_to_fp8(weight, scales),
        scales=scales,
        zeros=None,
        bits=8,
        group_size=-1,
        input_scale=None if input_scale is None else input_scale.float().reshape(1),
    )


def input_scale_from_absmax(absmax: float | Tensor) -> Tensor:
    """Static per-tensor activation scale [1] float32 from the calibration inputs' absmax."""
    return absmax_to_scale(torch.as_tensor(absmax, dtype=torch.float32).reshape(1))


class AbsmaxObserver:
    """Running max of |x| over calibration batches: the input of a static FP8 activation scale."""

    def __init__(self) -> None:
        self.absmax = 0.0

    def add_batch(self, x: Tensor) -> None:
        self.absmax = max(self.absmax, x.abs().max().item())

    def input_scale(self) -> Tensor:
        return input_scale_from_absmax(self.absmax)
