from __future__ import annotations

import torch
from torch import Tensor, nn

from llmc.kernels.norm import add_rms_norm, rms_norm, rms_norm_fp8


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, fp8_output: bool = False):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.empty(hidden_size, dtype=dtype, device="meta"))
        self.fp8_output = fp8_output  # output quantized per token for a w8a8-fp8 linear (an Fp8Activation)
        self.out_perm: Tensor | None = None  # the act-order gather of the linear it feeds (take_linear_perm)

    def forward(self, x: Tensor, residual: Tensor | None = None):
        """Without residual: rms_norm(x). With residual: (rms_norm(x + residual), x + residual). With
        fp8_output the normed values come as an Fp8Activation (kernels/norm.rms_norm_fp8)."""
        if self.fp8_output:
            normed, residual = rms_norm_fp8(x, self.weight, self.eps, residual)
            return normed if residual is None else (normed, residual)
        if residual is None:
            return rms_norm(x, self.weight, self.eps, self.out_perm)
        return add_rms_norm(x, residual, self.weight, self.eps, self.out_perm)

    def take_linear_perm(self, linear) -> bool:
        """After the weights load: the act-order gather x[..., perm] of `linear`, the only reader of this
        norm's output, done by the norm as it writes its output (Linear.take_perm), not by a kernel of its
        own before every product. Whether there was one to take (none with an FP8 output)."""
        if self.fp8_output or (perm := linear.take_perm()) is None:
            return False
        self.out_perm = perm
        return True

    def extra_repr(self) -> str:
        return "fp8_output=True" if self.fp8_output else ""
