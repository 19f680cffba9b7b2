"""FP8 (E4M3) scaling arithmetic shared by the w8a8-fp8 format, the FP8 quantizer and the reference.

A leaf module (torch only) so that `formats` and `fp8` can both use it without importing each other.
Convention (as compressed-tensors and vLLM): value ≈ fp8 * scale, scale = absmax / 448.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448.0
# A scale floor: an all-zero row would otherwise divide by zero.
MIN_SCALE = torch.finfo(torch.float32).tiny * 2**10


def absmax_to_scale(absmax: Tensor) -> Tensor:
    return (absmax.float() / FP8_E4M3_MAX).clamp(min=MIN_SCALE)


def cast_to_fp8(x: Tensor, scale: Tensor) -> Tensor:
    """x / scale saturated to ±448 and rounded to E4M3 (the cast alone would give NaN out of range)."""
    return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)


def quantize_fp8_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """Dynamic per-token activation quantization: x [..., in] → (fp8 [..., in], scale [..., 1] float32)."""
    scale = absmax_to_scale(x.abs().amax(dim=-1, keepdim=True))  # [..., 1]
    return cast_to_fp8(x, scale), scale


def quantize_fp8_static(x: Tensor, input_scale: Tensor) -> tuple[Tensor, Tensor]:
    """Static per-tensor activation quantization with a calibrated scale [1]: (fp8 [..., in], scale [1])."""
    scale = input_scale.float().reshape(1)
    return cast_to_fp8(x, scale), scale
