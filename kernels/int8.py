"""W8A8 INT8 linear: per-token dynamic int8 activations, int8 weights with per-output-channel scales.

Convention (vLLM's dynamic per-token int8, `scaled_int8_quant`): scale = max(absmax of the token / 127,
MIN_SCALE), x_int8 = clamp(round_half_even(x / scale), -127, 127), computed in float32 from x. Weights
int8 [N, K] (levels -128..127, compressed-tensors' symmetric int8) with weight_scale float32 [N, 1].

y = (x_int8 @ weight.T) * x_scale * weight_scale.T + bias: the integer product is exact (int32 sums,
|x_int8 * w| <= 127 * 128 per term: exact for K < 2**17), and the epilogue is the same float32 ops in
the same order on every device, so a CPU and a GPU give the same numbers up to that epilogue's rounding
(which is identical where both round float32 IEEE-correctly, as torch's elementwise ops do).

On CUDA with triton installed both steps are Triton kernels (int8_triton.py): the quantization in one
kernel, and the int8 GEMM with the epilogue fused, its kernel and tiles chosen by `select_int8_kernel`
(operands swapped for up to 64 tokens, split over K where the N tiles alone would leave SMs idle; a
tiled GEMM above). Both give the torch path's numbers bit for bit (the tests hold them to it).

The torch path (CPU, CUDA without triton, `triton=False`): torch._int_mm (oneDNN on CPU, cuBLAS int8 on
CUDA), then the epilogue as torch ops. cuBLAS needs more than 16 rows and K, N multiples of 8: M is padded
with zero rows; K or N that are not multiples of 8 (and a torch without _int_mm) take the float64
product, which is exact too (|sum| < 2**53).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import can_use_triton, device_num_sms

INT8_MAX = 127.0
MIN_SCALE = torch.finfo(torch.float32).tiny * 2**10  # an all-zero token would otherwise divide by zero
_CUBLAS_MIN_ROWS = 17  # torch._int_mm on CUDA: M > 16


def quantize_int8_per_token(x: Tensor, triton: bool = True) -> tuple[Tensor, Tensor]:
    """x [..., K] → (int8 [..., K], scale [..., 1] float32): each token at its own absmax / 127, rounded
    half to even, clamped to ±127. One Triton kernel on CUDA (unless `triton` is False), torch ops
    elsewhere: the same bits."""
    if triton and can_use_triton(x):
        from . import int8_triton  # triton loads on the first CUDA call only

        return int8_triton.quantize_int8_per_token(x, MIN_SCALE)
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # divided by a tensor, not the Python scalar: CUDA's division by a host scalar multiplies by its reciprocal,
    # one ulp off the CPU's (and vLLM's kernel's) true quotient at some amaxes (session 38, call 4)
    scale = (amax / torch.full_like(amax, INT8_MAX)).clamp(min=MIN_SCALE)
    return torch.round(xf / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def _float64_mm(a: Tensor, b: Tensor) -> Tensor:
    """The exact product where torch._int_mm cannot take it: float64 holds every int32 sum (|sum| < 2**53)."""
    return (a.double() @ b.double().T).to(torch.int32)


def int8_mm(a: Tensor, b: Tensor) -> Tensor:
    """a [M, K] int8 @ b [N, K].T int8 → [M, N] int32, exactly."""
    m, k = a.shape
    n = b.shape[0]
    if not hasattr(torch, "_int_mm") or (a.is_cuda and (k % 8 or n % 8)):
        return _float64_mm(a, b)
    if a.is_cuda:
        rows = max(_CUBLAS_MIN_ROWS, -(-m // 8) * 8)
        if rows != m:
            a = torch.cat([a, a.new_zeros(rows - m, k)])
        return torch._int_mm(a.contiguous(), b.t())[:m]
    try:
        return torch._int_mm(a.contiguous(), b.t())
    except RuntimeError:  # a CPU build without the int8 GEMM
        return _float64_mm(a, b)


SMALL_M = "small_m"  # int8_triton._int8_small_m_kernel: operands swapped, split over K
LARGE_M = "large_m"  # int8_triton._int8_large_m_kernel: tiled GEMM


def _tiles(kind: str, block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int,
           split_k: int = 1) -> dict:
    return dict(kind=kind, block_m=block_m, block_n=block_n, block_k=block_k, split_k=split_k,
                num_warps=num_warps, num_stages=num_stages)


# (max_m, tiles, wide_tiles): the first entry whose max_m >= M applies, LARGE_M_TILES above; wide_tiles (when
# given) for outputs of WIDE_N columns or more. Chosen on an H200 (session 38, `python -P benchmarks/bench_int8.py
# --sweep`, results/session38/call6.log: the GEMM alone at 16 tile sets, Llama-3-8B's four shapes): the fastest
# set per cell, where one set won every shape of a row, else the fastest for the shapes it covers.
WIDE_N = 16384
INT8_TILES: tuple = (
    (16, _tiles(SMALL_M, 16, 64, 256, 4, 4), _tiles(SMALL_M, 16, 128, 128, 8, 3)),
    (32, _tiles(SMALL_M, 32, 64, 256, 4, 4), None),  # (not measured)
    (64, _tiles(SMALL_M, 64, 64, 128, 4, 4), _tiles(LARGE_M, 64, 128, 128, 4, 4)),
    (256, _tiles(LARGE_M, 64, 128, 128, 4, 4), _tiles(LARGE_M, 256, 128, 128, 8, 3)),
)
LARGE_M_TILES = _tiles(LARGE_M, 128, 128, 64, 8, 4)


def select_int8_kernel(num_tokens: int, in_features: int, out_features: int, num_sms: int = 132) -> dict:
    """The Triton GEMM's keywords (int8_triton.int8_gemm) for M tokens x [M, K] and weight [N, K]: the
    tiles of INT8_TILES; for the few-token kernel, K split into as many parts as fill the `num_sms` SMs
    that the N (and token) tiles alone leave idle, each part at least 4 K steps."""
    tiles, wide = next(((t, w) for max_m, t, w in INT8_TILES if num_tokens <= max_m), (LARGE_M_TILES, None))
    if wide is not None and out_features >= WIDE_N:
        tiles = wide
    if tiles["kind"] == SMALL_M:
        output_tiles = -(-out_features // tiles["block_n"]) * -(-num_tokens // tiles["block_m"])
        steps = -(-in_features // tiles["block_k"])
        tiles = dict(tiles, split_k=max(1, min(num_sms // output_tiles, steps // 4)))
    return tiles


def int8_matmul(x_int8: Tensor, x_scale: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None,
                out_dtype: torch.dtype, triton: bool = True) -> Tensor:
    """y [..., N] in out_dtype from activations already quantized per token (x_scale [..., 1]): the Triton
    GEMM on CUDA (unless `triton` is False), else torch._int_mm and the epilogue as torch ops (same bits)."""
    x2 = x_int8.reshape(-1, x_int8.shape[-1])  # [M, K]
    if triton and can_use_triton(x2, weight) and x2.shape[1] > 0:
        from .int8_triton import int8_gemm

        m, k = x2.shape
        n = weight.shape[0]
        tiles = select_int8_kernel(m, k, n, device_num_sms(x2.device))
        xs = x_scale.float().reshape(-1)
        ws = weight_scale.float().reshape(-1)
        y = int8_gemm(x2 if x2.stride(1) == 1 else x2.contiguous(), xs.expand(m).contiguous(),
                      weight if weight.stride(1) == 1 else weight.contiguous(), ws.expand(n).contiguous(), bias,
                      out_dtype, **tiles)
        return y.reshape(*x_int8.shape[:-1], n)
    acc = int8_mm(x2, weight)  # [M, N] int32
    y = acc.float() * x_scale.float().reshape(-1, 1) * weight_scale.float().reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype).reshape(*x_int8.shape[:-1], weight.shape[0])


def int8_linear(x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None, triton: bool = True) -> Tensor:
    """y [..., N] in x's dtype = W8A8 int8 product of x [..., K] (quantized here, per token). `triton`
    False: the torch path on CUDA too (the fallback; benchmarks/bench_int8.py times both)."""
    x_int8, x_scale = quantize_int8_per_token(x, triton)
    return int8_matmul(x_int8, x_scale, weight, weight_scale, bias, x.dtype, triton)
