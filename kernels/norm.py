"""RMSNorm, optionally fused with the residual add.

Shapes: x, residual [num_tokens, hidden_size]; weight [hidden_size].
"""

from __future__ import annotations

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """y = x / sqrt(mean(x²) + eps) * weight, computed in float32, returned in x's dtype."""
    x_f32 = x.float()
    variance = x_f32.pow(2).mean(dim=-1, keepdim=True)
    return (x_f32 * torch.rsqrt(variance + eps)).to(x.dtype) * weight


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """residual' = x + residual; returns (rms_norm(residual'), residual')."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual
