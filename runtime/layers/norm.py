from __future__ import annotations

import torch
from torch import Tensor, nn

from llmc.kernels.norm import add_rms_norm, rms_norm, rms_norm_fp8


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, fp8_output: bool = False,
                 centered: bool = False):
        """centered (ModelConfig.layer_norm, Cohere): a LayerNorm without bias, the mean subtracted first."""
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.empty(hidden_size, dtype=dtype, device="meta"))
        # output quantized per token for a w8a8-fp8 linear (an Fp8Activation); not a LayerNorm's
        self.fp8_output = fp8_output and not centered
        self.out_perm: Tensor | None = None  # the act-order gather of the linear it feeds (take_linear_perm)
        self.is_centered = centered

    def forward(self, x: Tensor, residual: Tensor | None = None):
        """Without residual: rms_norm(x). With residual: (rms_norm(x + residual), x + residual). With
        fp8_output the normed values come as an Fp8Activation (kernels/norm.rms_norm_fp8)."""
        if self.is_centered:
            return self.layer_norm(x, residual)
        if self.fp8_output:
            normed, residual = rms_norm_fp8(x, self.weight, self.eps, residual)
            return normed if residual is None else (normed, residual)
        if residual is None:
            return rms_norm(x, self.weight, self.eps, self.out_perm)
        return add_rms_norm(x, residual, self.weight, self.eps, self.out_perm)

    def layer_norm(self, x: Tensor, residual: Tensor | None):
        """Cohere's LayerNorm (no bias) as transformers computes it, in float32: (x - mean) / sqrt(var + eps) * w,
        rounded to x's dtype; in torch on every device (no kernel of its own: a few elementwise ops, captured by the
        CUDA graphs as any other)."""
        if residual is not None:
            x = residual = x + residual
        x_f32 = x.float()
        centered = x_f32 - x_f32.mean(-1, keepdim=True)
        normed = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (self.weight.float() * normed).to(x.dtype)
        return out if residual is None else (out, residual)

    def take_linear_perm(self, linear) -> bool:
        """After the weights load: the act-order gather x[..., perm] of `linear`, the only reader of this
        norm's output, done by the norm as it writes its output (Linear.take_perm), not by a kernel of its
        own before every product. Whether there was one to take (none with an FP8 output; a LayerNorm leaves it to the
        linear)."""
        if self.fp8_output or self.is_centered or (perm := linear.take_perm()) is None:
            return False
        self.out_perm = perm
        return True

    def extra_repr(self) -> str:
        return "fp8_output=True" if self.fp8_output else ""
