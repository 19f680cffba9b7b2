"""FP8 (E4M3) quantization for the `w8a8-fp8` format (weights per channel or per tensor, activation scales) and
the `w8a8-fp8-block` format (weights in 128 x 128 blocks, activations per token and 128 columns).

scale = absmax / 448 (E4M3's largest finite value), fp8 = saturate(value / scale): the convention of
compressed-tensors' float-quantized checkpoints and vLLM, so imported FP8 weights need no rescaling.
Activations are quantized per token at run time (`quantize_fp8_per_token`) or, for static input
scales, with `input_scale_from_absmax` of the calibration inputs (`AbsmaxObserver`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmc.kernels.fp8 import expand_group_scales
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
    "quantize_fp8_weight_block",
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


def quantize_fp8_weight_block(weight: Tensor, block_size: tuple[int, int]) -> QuantizedWeight:
    """weight [out, in] → E4M3 levels with one scale per block of block_size = (rows, columns), absmax / 448 of
    the block (llm-compressor's FP8_BLOCK, DeepSeek-V3's and Qwen3's FP8 checkpoints: blocks from row 0 and
    column 0, the last ones partial). The scales come back per row, [out, ceil(in / columns)] (`w8a8-fp8-block`
    stores them so: fused q/k/v rows and tensor-parallel shards need no block alignment); the rows of a block
    hold the same scale. group_size = columns: w[o, i] = qweight[o, i] * scales[o, i // columns]."""
    rows, columns = block_size
    out_features, in_features = weight.shape
    padded = torch.nn.functional.pad(weight.float(), (0, -in_features % columns, 0, -out_features % rows))
    blocks = padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // columns, columns)
    scales = absmax_to_scale(blocks.abs().amax(dim=(1, 3)))  # [row blocks, column blocks]
    scales = scales.repeat_interleave(rows, dim=0)[:out_features].contiguous()  # [out, column blocks]
    qweight = cast_to_fp8(weight, expand_group_scales(scales, columns, in_features))
    return QuantizedWeight(qweight=qweight, scales=scales, zeros=None, bits=8, group_size=columns)


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
