"""Triton kernels of the W8A8 int8 linear on CUDA (imported only when a kernel runs): the per-token
int8 quantization and the int8 GEMM with its scale epilogue fused.

Both give kernels/int8.py's torch computation bit for bit:

- quantization: one program per token; scale = max(absmax / 127, min_scale), level = x / scale rounded
  half to even, clamped to ±127. Both divisions are IEEE (`div_rn`; Triton's default fp32 `/` is
  approximate), the rounding is the float32 add-and-subtract of 1.5 * 2**23 (exact round-to-nearest-even
  for |v| <= 127 < 2**22, in numpy as on the GPU: Triton's interpreter has no libdevice `rint`).
- GEMM: int8 operands, int32 accumulation in tl.dot (exact in any order), then acc (float32) * x_scale[m]
  * w_scale[n] (+ bias), the same float32 ops in the same order as torch's epilogue, launched with
  `enable_fp_fusion=False` so the bias add is not folded into an FMA (torch rounds the product first).

Two GEMM kernels, chosen by `int8.select_int8_kernel`: for a few tokens the operands are swapped
(out.T = W @ x.T: the weight rows fill the MMA's 64-row side and the tokens its narrow one, as
fp8_triton's few-token kernel does), optionally split over K with int32 partials summed by the last
split of a tile to arrive (integers: the order cannot change the sum); for more tokens a plain tiled
GEMM, its tiles walked in groups of GROUP_M rows for L2 reuse of the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .fp8 import ONE_PASS_MAX
from .fp8_triton import quantize_per_token
from .pdl_triton import pdl_args, wait_for_inputs
from .split_k_triton import tile_counters


def quantize_int8_per_token(x: Tensor, min_scale: float, one_pass_max: int = ONE_PASS_MAX) -> tuple[Tensor, Tensor]:
    """x [..., K] (bf16, fp16, fp32) → (int8 [..., K], scale [..., 1] float32), as
    int8.quantize_int8_per_token computes them: fp8_triton's per-token kernel with 127 and integer levels."""
    return quantize_per_token(x, min_scale, torch.int8, one_pass_max)


@triton.jit
def _epilogue_store(acc, xs_ptr, ws_ptr, bias_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, stride_om,
                    HAS_BIAS: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] int32 → out: (acc (float32) * x_scale) * w_scale (+ bias), cast."""
    x_scale = tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)
    w_scale = tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)
    y = acc.to(tl.float32) * x_scale[:, None]
    y = y * w_scale[None, :]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _int8_small_m_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, part_ptr, counter_ptr, M, N, K, k_per_split,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """A few tokens, operands swapped: acc.T [BLOCK_N, BLOCK_M] = w [BLOCK_N, K] @ x.T [K, BLOCK_M].
    Grid (N tiles, K splits, token tiles). With SPLITS > 1 each split stores its int32 partial and
    counts itself on the tile's semaphore; the last to arrive sums the partials, runs the epilogue and
    puts the semaphore back to zero (split_k_triton.store_split's protocol, on integers)."""
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.int32)
    k_begin = pid_k * k_per_split
    wait_for_inputs(PDL)
    for k0 in range(k_begin, tl.minimum(k_begin + k_per_split, K), BLOCK_K):
        k_mask = k0 + offs_k < K
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k0 + offs_k)[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0)
        acc = tl.dot(w, tl.trans(x), acc, out_dtype=tl.int32)
    acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    if SPLITS > 1:
        offs = offs_m[:, None] * N + offs_n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        tl.store(part_ptr + pid_k * M * N + offs, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is stored before the count is released
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
            for split in tl.static_range(SPLITS):
                total += tl.load(part_ptr + split * M * N + offs, mask=mask, other=0, cache_modifier=".cg")
            _epilogue_store(total, xs_ptr, ws_ptr, bias_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, stride_om,
                            HAS_BIAS)
            tl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")
    else:
        _epilogue_store(acc, xs_ptr, ws_ptr, bias_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, stride_om, HAS_BIAS)


@triton.jit
def _int8_large_m_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, PDL: tl.constexpr,
):
    """acc [BLOCK_M, BLOCK_N] = x [BLOCK_M, K] @ w.T [K, BLOCK_N], one program per output tile; the
    tiles in groups of GROUP_M token tiles per weight column tile (consecutive programs share w)."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    wait_for_inputs(PDL)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + offs_k < K
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0)
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0)
        acc = tl.dot(x, tl.trans(w), acc, out_dtype=tl.int32)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    _epilogue_store(acc, xs_ptr, ws_ptr, bias_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, stride_om, HAS_BIAS)


def int8_gemm(
    x_int8: Tensor, x_scale: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None,
    out_dtype: torch.dtype, kind: str = "large_m", block_m: int = 128, block_n: int = 128, block_k: int = 128,
    split_k: int = 1, num_warps: int = 8, num_stages: int = 3, group_m: int = 8,
) -> Tensor:
    """x_int8 [M, K] (unit stride along K), x_scale [M] or [M, 1] float32, weight [N, K] int8 (unit
    stride along K), weight_scale [N] or [N, 1] float32, bias [N] or None → [M, N] in out_dtype:
    int8.int8_matmul's numbers. kind "small_m" (operands swapped, split over K) or "large_m"."""
    M, K = x_int8.shape
    N = weight.shape[0]
    out = torch.empty(M, N, device=x_int8.device, dtype=out_dtype)
    if M == 0:
        return out
    xs, ws = x_scale.reshape(-1), weight_scale.reshape(-1)
    assert xs.dtype == ws.dtype == torch.float32 and xs.is_contiguous() and ws.is_contiguous()
    assert x_int8.stride(1) == 1 and weight.stride(1) == 1 and xs.numel() == M and ws.numel() == N
    bias_arg = bias if bias is not None else ws
    launch = dict(num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False, **pdl_args(x_int8.device))
    if kind == "large_m":
        grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
        _int8_large_m_kernel[grid](
            x_int8, xs, weight, ws, bias_arg, out, M, N, K, x_int8.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, **launch,
        )
        return out
    tiles_n, tiles_m = triton.cdiv(N, block_n), triton.cdiv(M, block_m)
    blocks_per_split = triton.cdiv(triton.cdiv(K, block_k), max(1, split_k))
    splits = triton.cdiv(triton.cdiv(K, block_k), blocks_per_split)  # none empty
    counters = tile_counters(x_int8.device, tiles_n * tiles_m) if splits > 1 else None
    if counters is None:  # not split, or no semaphores to be had inside a CUDA-graph capture
        splits, blocks_per_split = 1, triton.cdiv(K, block_k)
    parts = torch.empty(splits, M, N, device=x_int8.device, dtype=torch.int32) if splits > 1 else out
    _int8_small_m_kernel[(tiles_n, splits, tiles_m)](
        x_int8, xs, weight, ws, bias_arg, out, parts, counters if counters is not None else xs, M, N, K,
        blocks_per_split * block_k, x_int8.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SPLITS=splits, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **launch,
    )
    return out
