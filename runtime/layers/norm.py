from __future__ import annotations

import torch
from torch import Tensor, nn

from llmc.kernels.norm import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.empty(hidden_size, dtype=dtype, device="meta"))

    def forward(self, x: Tensor, residual: Tensor | None = None):
        """Without residual: rms_norm(x). With residual: (rms_norm(x + residual), x + residual)."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
