"""RMSNorm, optionally fused with the residual add.

Shapes: x, residual [num_tokens, hidden_size] (or [num_tokens, num_heads, head_dim] for q/k norms);
weight [hidden_size]. On CUDA one Triton kernel (norm_triton.py) per call; elsewhere plain torch.
`rms_norm_fp8` also quantizes the output per token for a w8a8-fp8 linear (kernels/fp8.py), in the
same kernel on CUDA.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import can_use_triton
from .fp8 import MIN_SCALE, ONE_PASS_MAX, Fp8Activation, quantize_fp8_per_token


def rms_norm(x: Tensor, weight: Tensor, eps: float, perm: Tensor | None = None) -> Tensor:
    """y = x / sqrt(mean(x²) + eps) * weight, computed in float32, returned in x's dtype; with `perm`,
    y[..., perm] (the gather of the act-order linear that reads y, in the same kernel on CUDA)."""
    if can_use_triton(x, weight):
        from . import norm_triton  # triton loads on the first CUDA call only

        return norm_triton.rms_norm(x, weight, eps, perm=perm)[0]
    x_f32 = x.float()
    variance = x_f32.pow(2).mean(dim=-1, keepdim=True)
    y = (x_f32 * torch.rsqrt(variance + eps)).to(x.dtype) * weight
    return y if perm is None else y.index_select(-1, perm)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float, perm: Tensor | None = None,
                 ) -> tuple[Tensor, Tensor]:
    """residual' = x + residual; returns (rms_norm(residual', perm=perm), residual')."""
    if can_use_triton(x, residual, weight):
        from . import norm_triton

        return norm_triton.rms_norm(x, weight, eps, residual, perm)
    residual = x + residual
    return rms_norm(residual, weight, eps, perm), residual


def rms_norm_fp8(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None,
                 ) -> tuple[Fp8Activation, Tensor | None]:
    """(quantize_fp8_per_token(rms_norm(x [+ residual])), x + residual or None): the same values and
    scales as the two calls, from one kernel on CUDA (rows of up to ONE_PASS_MAX values, weight in x's
    dtype; two kernels otherwise)."""
    if can_use_triton(x, weight, *([] if residual is None else [residual])) and x.dtype == weight.dtype \
            and x.shape[-1] <= ONE_PASS_MAX:
        from . import norm_triton

        values, scale, residual = norm_triton.rms_norm_fp8(x, weight, eps, residual, MIN_SCALE)
        return Fp8Activation(values, scale, x.dtype), residual
    if residual is None:
        normed = rms_norm(x, weight, eps)
    else:
        normed, residual = add_rms_norm(x, residual, weight, eps)
    return Fp8Activation(*quantize_fp8_per_token(normed), normed.dtype), residual
