"""W8A8 FP8 linear: per-token dynamic activation quantization feeding torch._scaled_mm (rowwise scales).

Shapes: x [..., K] in the model dtype; weight [N, K] float8_e4m3fn; weight_scale [N, 1] or [1, 1]
float32. Convention as llmc.quant.numerics (value ≈ fp8 * scale, scale = absmax / 448, floored at
MIN_SCALE), which the kernel tests check against.

`quantize_fp8_per_token` is one Triton kernel on CUDA (fp8_triton.py) instead of torch's five
(abs, amax, div, clamp, cast); plain torch elsewhere. The product is torch._scaled_mm, except for a
few tokens (`uses_small_m_kernel`), where a Triton kernel with the operands swapped reads the weight
at 1.2-1.9x the bf16 matmul's speed where _scaled_mm was 0.8-1.6x (H100, benchmarks/RESULTS.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import can_use_triton, is_triton_installed

FP8_E4M3_MAX = 448.0
MIN_SCALE = torch.finfo(torch.float32).tiny * 2**10  # an all-zero row would otherwise divide by zero


def quantize_fp8_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., K] → (fp8 [..., K], scale [..., 1] float32), scale = max(absmax / 448, MIN_SCALE)."""
    if can_use_triton(x):
        from . import fp8_triton  # triton loads on the first CUDA call only

        return fp8_triton.quantize_fp8_per_token(x, MIN_SCALE)
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_E4M3_MAX).clamp(min=MIN_SCALE)
    return cast_to_fp8(x, scale), scale


def cast_to_fp8(x: Tensor, scale: Tensor) -> Tensor:
    """x / scale saturated to ±448 and rounded to E4M3 (the cast alone would give NaN out of range)."""
    return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def has_fp8_tensor_cores(x: Tensor) -> bool:
    """FP8 matmuls need CUDA capability 8.9+ (Ada, Hopper)."""
    return x.is_cuda and torch.cuda.get_device_capability(x.device) >= (8, 9)


def can_use_scaled_mm(x: Tensor, weight: Tensor) -> bool:
    """torch._scaled_mm needs FP8 tensor cores and both weight dims multiples of 16."""
    return has_fp8_tensor_cores(x) and all(d % 16 == 0 for d in weight.shape)


def uses_small_m_kernel(num_tokens: int, out_features: int) -> bool:
    """Where the Triton small-M kernel beat torch._scaled_mm on the H100 (Llama-3-8B shapes): up to
    16 tokens everywhere, up to 64 on the 4096-wide outputs."""
    return num_tokens <= 16 or (num_tokens <= 64 and out_features <= 4096)


def _small_m_config(k: int, n: int) -> dict:
    """The tiles the H100 sweep chose (benchmarks/kernel_sweep.py): wider N tiles for wide outputs,
    split-K for long rows."""
    block_n = 128 if n >= 16384 else 64
    return dict(block_n=block_n, block_k=256, split_k=2 if k >= 8192 else 1, num_warps=4,
                num_stages=3 if block_n == 128 else 4)


def fp8_linear(x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None) -> Tensor:
    """y [..., N] in x's dtype = (x_fp8 * x_scale) @ (weight * weight_scale).T + bias, fp32 accumulation."""
    x_fp8, x_scale = quantize_fp8_per_token(x)  # [..., K], [..., 1]
    return fp8_matmul(x_fp8, x_scale, weight, weight_scale, bias, x.dtype)


def fp8_matmul(x_fp8: Tensor, x_scale: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None,
               out_dtype: torch.dtype) -> Tensor:
    """y [..., N] in out_dtype = (x_fp8 * x_scale) @ (weight * weight_scale).T + bias for activations
    already in FP8: x_scale [..., 1] per token, or one scale ([1] / [1, 1], a static input scale).
    The small-M Triton kernel for few tokens, torch._scaled_mm otherwise, float32 math without FP8
    tensor cores."""
    x2 = x_fp8.reshape(-1, x_fp8.shape[-1])  # [num_tokens, K]
    scale_a = x_scale.float().reshape(-1, 1)
    if scale_a.shape[0] != x2.shape[0]:
        scale_a = scale_a.expand(x2.shape[0], 1).contiguous()
    out_features = weight.shape[0]
    if not can_use_scaled_mm(x_fp8, weight):
        w = weight.float() * weight_scale.float()  # [N, K]
        y = (x2.float() * scale_a) @ w.T
        y = y + bias.float() if bias is not None else y
        return y.to(out_dtype).reshape(*x_fp8.shape[:-1], out_features)
    if uses_small_m_kernel(x2.shape[0], out_features) and is_triton_installed():
        from .fp8_triton import fp8_linear_small_m

        y = fp8_linear_small_m(x2.contiguous(), scale_a, weight, weight_scale.float(), bias, out_dtype,
                               **_small_m_config(x_fp8.shape[-1], out_features))
        return y.reshape(*x_fp8.shape[:-1], out_features)
    scale_b = weight_scale.float().reshape(1, -1)  # [1, N] or [1, 1]
    if scale_b.shape[1] != out_features:
        scale_b = scale_b.expand(1, out_features).contiguous()
    y = torch._scaled_mm(x2, weight.t(), scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)
    return y.reshape(*x_fp8.shape[:-1], out_features)
