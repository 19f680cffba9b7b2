"""RMSNorm, optionally fused with the residual add.

Shapes: x, residual [num_tokens, hidden_size] (or [num_tokens, num_heads, head_dim] for q/k norms);
weight [hidden_size]. On CUDA one Triton kernel (norm_triton.py) per call; elsewhere plain torch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import can_use_triton


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """y = x / sqrt(mean(x²) + eps) * weight, computed in float32, returned in x's dtype."""
    if can_use_triton(x, weight):
        from . import norm_triton  # triton loads on the first CUDA call only

        return norm_triton.rms_norm(x, weight, eps)[0]
    x_f32 = x.float()
    variance = x_f32.pow(2).mean(dim=-1, keepdim=True)
    return (x_f32 * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual')."""
    if can_use_triton(x, residual, weight):
        from . import norm_triton

        return norm_triton.rms_norm(x, weight, eps, residual)
    residual = x + residual
    return rms_norm(residual, weight, eps), residual
