"""W8A8 INT8 linear: per-token dynamic int8 activations, int8 weights with per-output-channel scales.

Convention (vLLM's dynamic per-token int8, `scaled_int8_quant`): scale = max(absmax of the token / 127,
MIN_SCALE), x_int8 = clamp(round_half_even(x / scale), -127, 127), computed in float32 from x. Weights
int8 [N, K] (levels -128..127, compressed-tensors' symmetric int8) with weight_scale float32 [N, 1].

y = (x_int8 @ weight.T) * x_scale * weight_scale.T + bias: the integer product is exact (int32 sums,
|x_int8 * w| <= 127 * 128 per term: exact for K < 2**17), and the epilogue is the same float32 ops in
the same order on every device, so a CPU and a GPU give the same numbers up to that epilogue's rounding
(which is identical where both round float32 IEEE-correctly, as torch's elementwise ops do).

The product: torch._int_mm (cuBLAS int8 GEMM on CUDA, oneDNN on CPU). cuBLAS needs more than 16 rows
and K, N multiples of 8: M is padded with zero rows; K or N that are not multiples of 8 (and a torch
without _int_mm) take the float64 product, which is exact too (|sum| < 2**53).
"""

from __future__ import annotations

import torch
from torch import Tensor

INT8_MAX = 127.0
MIN_SCALE = torch.finfo(torch.float32).tiny * 2**10  # an all-zero token would otherwise divide by zero
_CUBLAS_MIN_ROWS = 17  # torch._int_mm on CUDA: M > 16


def quantize_int8_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., K] → (int8 [..., K], scale [..., 1] float32): each token at its own absmax / 127, rounded
    half to even, clamped to ±127."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # divided by a tensor, not the Python scalar: CUDA's division by a host scalar multiplies by its reciprocal,
    # one ulp off the CPU's (and vLLM's kernel's) true quotient at some amaxes (session 38, call 4)
    scale = (amax / torch.full_like(amax, INT8_MAX)).clamp(min=MIN_SCALE)
    return torch.round(xf / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def int8_mm(a: Tensor, b: Tensor) -> Tensor:
    """a [M, K] int8 @ b [N, K].T int8 → [M, N] int32, exactly."""
    m, k = a.shape
    n = b.shape[0]
    if not hasattr(torch, "_int_mm"):
        return (a.double() @ b.double().T).to(torch.int32)
    if a.is_cuda:
        if k % 8 or n % 8:
            return (a.double() @ b.double().T).to(torch.int32)
        rows = max(_CUBLAS_MIN_ROWS, -(-m // 8) * 8)
        if rows != m:
            a = torch.cat([a, a.new_zeros(rows - m, k)])
        return torch._int_mm(a.contiguous(), b.t())[:m]
    try:
        return torch._int_mm(a.contiguous(), b.t())
    except RuntimeError:  # a CPU build without the int8 GEMM
        return (a.double() @ b.double().T).to(torch.int32)


def int8_matmul(x_int8: Tensor, x_scale: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None,
                out_dtype: torch.dtype) -> Tensor:
    """y [..., N] in out_dtype from activations already quantized per token (x_scale [..., 1])."""
    x2 = x_int8.reshape(-1, x_int8.shape[-1])  # [M, K]
    acc = int8_mm(x2, weight)  # [M, N] int32
    y = acc.float() * x_scale.float().reshape(-1, 1) * weight_scale.float().reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype).reshape(*x_int8.shape[:-1], weight.shape[0])


def int8_linear(x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None) -> Tensor:
    """y [..., N] in x's dtype = W8A8 int8 product of x [..., K] (quantized here, per token)."""
    x_int8, x_scale = quantize_int8_per_token(x)
    return int8_matmul(x_int8, x_scale, weight, weight_scale, bias, x.dtype)
