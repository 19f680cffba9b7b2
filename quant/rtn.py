"""Round-to-nearest integer quantization, and the scale/zero convention every int algorithm shares.

Convention, the one compressed-tensors (llm-compressor) and GPTQ use, so that our own weights and
imported checkpoints dequantize identically — w = (level - zero) * scale:
  symmetric:  scale = absmax / ((2**bits - 1) / 2), zero = 2**(bits-1)
              (levels [0, 2**bits) are compressed-tensors' signed [-2**(bits-1), 2**(bits-1)) + 2**(bits-1);
              +absmax lands on 2**(bits-1) - 0.5 steps and clamps to the top level)
  asymmetric: [lo, hi] = [min(w_min, 0), max(w_max, 0)] (0 stays exactly representable),
              scale = (hi - lo) / (2**bits - 1), zero = clamp(round(-lo / scale), 0, 2**bits - 1)
  level = clamp(round(w / scale) + zero, 0, 2**bits - 1), rounding half to even (torch.round).
Scales are floored at float32 eps (an all-zero group) and, when `scale_dtype` is given, rounded to
the dtype they will be stored in before the levels are computed, so stored weights mean exactly
what the algorithm chose.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmc.errors import RecipeError
from llmc.quant.formats import QuantizedWeight, num_groups_of

MIN_SCALE = torch.finfo(torch.float32).eps


def check_bits(bits: int) -> None:
    if not 2 <= bits <= 8:
        raise RecipeError(
            f"cannot quantize to {bits} bits; use bits between 2 and 8 (3, 4 or 8 for the formats)"
        )


def compute_qparams(
    w: Tensor,
    bits: int,
    symmetric: bool,
    clip_ratio: Tensor | float | None = None,
    scale_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Scale and zero over the last dim: w [..., k] → (scales [...] float32, zeros [...] int32 | None).

    clip_ratio ([...] or a float) shrinks the range before the scale is taken (AWQ's clip search).
    """
    max_level = 2**bits - 1
    lo = w.float().amin(dim=-1).clamp(max=0)  # [...]
    hi = w.float().amax(dim=-1).clamp(min=0)
    if clip_ratio is not None:
        lo, hi = lo * clip_ratio, hi * clip_ratio
    if symmetric:
        scales = torch.maximum(-lo, hi) / (max_level / 2)
    else:
        scales = (hi - lo) / max_level
    scales = scales.clamp(min=MIN_SCALE)
    if scale_dtype is not None:
        scales = scales.to(scale_dtype).float().clamp(min=MIN_SCALE)
    if symmetric:
        return scales, None
    return scales, torch.round(-lo / scales).clamp(0, max_level).to(torch.int32)


def quantize_levels(w: Tensor, scales: Tensor, zeros: Tensor | None, bits: int) -> Tensor:
    """Levels int32 of w; scales/zeros broadcast against w (zeros None = symmetric, 2**(bits-1))."""
    zero = 2 ** (bits - 1) if zeros is None else zeros.float()
    return torch.clamp(torch.round(w.float() / scales) + zero, 0, 2**bits - 1).to(torch.int32)


def dequantize_levels(levels: Tensor, scales: Tensor, zeros: Tensor | None, bits: int) -> Tensor:
    zero = 2 ** (bits - 1) if zeros is None else zeros.float()
    return (levels.float() - zero) * scales


def _grouped(weight: Tensor, group_size: int) -> Tensor:
    """[out, in] → [out, num_groups, group_size] (one group of `in` per channel when group_size is -1)."""
    num_groups = num_groups_of(weight.shape[1], group_size)
    return weight.float().reshape(weight.shape[0], num_groups, -1)


def rtn_quantize(
    weight: Tensor,
    bits: int,
    group_size: int,
    symmetric: bool,
    *,
    clip_ratio: Tensor | float | None = None,
    scales: Tensor | None = None,
    zeros: Tensor | None = None,
    scale_dtype: torch.dtype | None = None,
) -> QuantizedWeight:
    """Round-to-nearest: weight [out, in] → QuantizedWeight with contiguous groups.

    clip_ratio: [out, num_groups] or a float, from AWQ's clip search. scales/zeros [out, num_groups]:
    fixed group parameters to round against instead of computing them (zeros None = symmetric).
    """
    check_bits(bits)
    groups = _grouped(weight, group_size)  # [out, G, group_size]
    if scales is None:
        scales, zeros = compute_qparams(groups, bits, symmetric, clip_ratio, scale_dtype)  # [out, G]
    levels = quantize_levels(
        groups, scales.unsqueeze(-1), None if zeros is None else zeros.unsqueeze(-1), bits
    )
    return QuantizedWeight(
        qweight=levels.reshape(weight.shape),
        scales=scales.float(),
        zeros=zeros,
        bits=bits,
        group_size=group_size,
    )


def fake_quantize(
    weight: Tensor,
    bits: int,
    group_size: int,
    symmetric: bool,
    clip_ratio: Tensor | float | None = None,
    scale_dtype: torch.dtype | None = None,
) -> Tensor:
    """Quantize then dequantize: weight [out, in] → float32 [out, in] (what AWQ's searches score)."""
    check_bits(bits)
    groups = _grouped(weight, group_size)  # [out, G, group_size]
    scales, zeros = compute_qparams(groups, bits, symmetric, clip_ratio, scale_dtype)  # [out, G]
    scales = scales.unsqueeze(-1)
    zeros = None if zeros is None else zeros.unsqueeze(-1)
    levels = quantize_levels(groups, scales, zeros, bits)
    return dequantize_levels(levels, scales, zeros, bits).reshape(weight.shape)
