"""Triton per-token dynamic FP8 (E4M3) activation quantization (imported only when a kernel runs); the same
kernel quantizes to int8 for W8A8 int8 (int8_triton.quantize_int8_per_token).

One program per token. A row of up to ONE_PASS_MAX values is loaded once, kept in registers, and
its absmax, scale and quantized values come from that one load: a few tokens (a decode step) wait
for one memory round trip per program, not four or more (a 14336-wide row in 4096-wide chunks,
read twice, took 11 µs at M = 1 on an H100; benchmarks/RESULTS.md, session 10). Longer rows take two
passes: the absmax, then the division, the row's second read hitting L1/L2. Either way each value is
divided by the scale (IEEE division), saturated to ±448 and cast (round to nearest even); HBM
traffic is the 16-bit row in, the fp8 row and one float32 scale out.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from .fp8 import ONE_PASS_MAX
from .pdl_triton import pdl_args, wait_for_inputs
from .split_k_triton import finish_splits, plan_splits, store_split

FP8_E4M3_MAX = tl.constexpr(448.0)
MAX_BLOCK = 4096  # chunk of the two-pass loop
ROUNDER = tl.constexpr(12582912.0)  # 1.5 * 2**23: v + ROUNDER - ROUNDER rounds v (|v| < 2**22) half to even


@triton.jit
def quantize_row(row, mask, out_ptrs, scale_ptr, min_scale):
    """One token's values (float32, in registers; 0 where masked) to E4M3 at out_ptrs and its scale at
    scale_ptr: scale = max(absmax / 448, min_scale), each value divided by it, saturated, rounded to
    nearest even. div_rn: IEEE division as torch does; the default fp32 division is approximate and
    moves quotients that sit on an e4m3 rounding tie."""
    row_scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(row), axis=0), FP8_E4M3_MAX), min_scale)
    tl.store(scale_ptr, row_scale)
    q = tl.clamp(tl.math.div_rn(row, row_scale), -FP8_E4M3_MAX, FP8_E4M3_MAX)
    tl.store(out_ptrs, q.to(out_ptrs.dtype.element_ty), mask=mask)


def one_pass_warps(block: int) -> int:
    """Warps of a program that holds a row of `block` values in registers (up to ONE_PASS_MAX)."""
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


@triton.jit
def _levels(x, scale, QMAX: tl.constexpr, INT: tl.constexpr):
    """float32 values → quantized values at `scale`, still float32: IEEE x / scale clamped to ±QMAX, and for an
    integer type rounded half to even by adding and subtracting 1.5 * 2**23 (exact for |v| < 2**22, in numpy as
    on the GPU: Triton's interpreter has no libdevice `rint`); the store's cast to FP8 rounds to nearest even."""
    v = tl.clamp(tl.math.div_rn(x, scale), -QMAX, QMAX)
    if INT:
        v = (v + ROUNDER) - ROUNDER
    return v


@triton.jit
def _quantize_per_token_kernel(
    x_ptr, out_ptr, scale_ptr, size, stride_x, min_scale, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
    PDL: tl.constexpr, QMAX: tl.constexpr, INT: tl.constexpr,
):
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    out_type = out_ptr.dtype.element_ty
    if ONE_PASS:  # BLOCK >= size: the row stays in registers
        mask = offs < size
        row = tl.load(x_ptr + token * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(row), axis=0), QMAX), min_scale)
        tl.store(scale_ptr + token, scale)
        tl.store(out_ptr + token * size + offs, _levels(row, scale, QMAX, INT).to(out_type), mask=mask)
    else:
        absmax = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, size, BLOCK):
            x = tl.load(x_ptr + token * stride_x + start + offs, mask=start + offs < size, other=0.0)
            absmax = tl.maximum(absmax, tl.abs(x.to(tl.float32)))
        scale = tl.maximum(tl.math.div_rn(tl.max(absmax, axis=0), QMAX), min_scale)
        tl.store(scale_ptr + token, scale)
        for start in range(0, size, BLOCK):
            mask = start + offs < size
            y = tl.load(x_ptr + token * stride_x + start + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptr + token * size + start + offs, _levels(y, scale, QMAX, INT).to(out_type), mask=mask)


QUANTIZED_TYPES = {torch.float8_e4m3fn: (448.0, False), torch.int8: (127.0, True)}  # dtype: (largest level, integer)


def quantize_per_token(x: Tensor, min_scale: float, dtype: torch.dtype = torch.float8_e4m3fn,
                       one_pass_max: int = ONE_PASS_MAX) -> tuple[Tensor, Tensor]:
    """x [..., K] (bf16, fp16, fp32) → (`dtype` [..., K], scale [..., 1] float32): scale = max(absmax / QMAX,
    min_scale) per token, for E4M3 (QMAX 448) or int8 (127, levels rounded half to even). `one_pass_max`: rows
    longer than this take two passes (a test lowers it to reach that path at small sizes)."""
    qmax, is_int = QUANTIZED_TYPES[dtype]
    size = x.shape[-1]
    rows = x.reshape(-1, size)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, device=x.device, dtype=dtype)
    scale = torch.empty(*x.shape[:-1], 1, device=x.device, dtype=torch.float32)
    if rows.shape[0] == 0:
        return out, scale
    one_pass = size <= one_pass_max
    block = triton.next_power_of_2(size) if one_pass else min(MAX_BLOCK, triton.next_power_of_2(one_pass_max))
    _quantize_per_token_kernel[(rows.shape[0],)](
        rows, out, scale, size, rows.stride(0), min_scale, BLOCK=block, ONE_PASS=one_pass, QMAX=qmax, INT=is_int,
        num_warps=one_pass_warps(block), **pdl_args(x.device),
    )
    return out, scale


@triton.jit
def _quantize_groups_kernel(x_ptr, out_ptr, scale_ptr, M, ROWS, K, stride_x, min_scale, GROUP: tl.constexpr,
                            GROUPS: tl.constexpr, PDL: tl.constexpr):
    """GROUPS groups of GROUP columns of one token per program, as a [GROUPS, GROUP] tile: each row's absmax, its
    scale (stored at scale_ptr[group * ROWS + token]: the scales of one group are contiguous over the tokens, the
    layout cuBLAS's block-scaled GEMM reads) and its E4M3 values. Tokens M..ROWS-1 (padding) are zeros."""
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    columns = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = (groups[:, None] * GROUP < K) & (columns < K)
    tile = tl.load(x_ptr + token * stride_x + columns, mask=mask & (token < M), other=0.0).to(tl.float32)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(tile), axis=1), FP8_E4M3_MAX), min_scale)  # [GROUPS]
    tl.store(scale_ptr + groups * ROWS + token, scale, mask=groups * GROUP < K)
    values = tl.clamp(tl.math.div_rn(tile, scale[:, None]), -FP8_E4M3_MAX, FP8_E4M3_MAX)
    tl.store(out_ptr + token * K + columns, values.to(out_ptr.dtype.element_ty), mask=mask)


def quantize_fp8_per_token_group(x: Tensor, group_size: int, min_scale: float, rows: int | None = None,
                                 pdl: bool | None = None) -> tuple[Tensor, Tensor]:
    """x [M, K] → (fp8 [rows, K], scale [rows, ceil(K / group_size)] float32 with strides (1, rows): the group's
    scales contiguous over the tokens, as cuBLAS's block-scaled GEMM takes them); group_size a power of two.
    rows (default M) >= M: the rows past M are zeros at the smallest scale (cuBLAS takes a multiple of 4 rows).
    pdl: launch with programmatic dependent launch (None: as every kernel on this device, kernels.use_pdl)."""
    M, K = x.shape
    rows = M if rows is None else rows
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_groups = triton.cdiv(K, group_size)
    out = torch.empty(rows, K, device=x.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty(num_groups, rows, device=x.device, dtype=torch.float32).t()
    groups_per_program = max(1, min(triton.next_power_of_2(num_groups), 2048 // group_size))
    if rows:
        _quantize_groups_kernel[(rows, triton.cdiv(num_groups, groups_per_program))](
            x, out, scale, M, rows, K, x.stride(0), min_scale, GROUP=group_size, GROUPS=groups_per_program,
            num_warps=4, **(pdl_args(x.device) if pdl is None else {"PDL": pdl, "launch_pdl": pdl}))
    return out, scale


def quantize_fp8_per_token(x: Tensor, min_scale: float) -> tuple[Tensor, Tensor]:
    """x [..., K] → (fp8 [..., K], scale [..., 1] float32)."""
    return quantize_per_token(x, min_scale)


@triton.jit
def _fp8_small_m_kernel(
    xq_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, final_ptr, counter_ptr, M, N, K, k_per_split,
    stride_om, stride_split, stride_xs, stride_xsg, stride_ws, stride_wsg,
    W_SCALE_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr, IS_SPLIT: tl.constexpr, SUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr, GROUP: tl.constexpr,
):
    """W8A8 for a few tokens on FP8 tensor cores with the operands swapped: out.T [BLOCK_N, BLOCK_M]
    = w @ xq.T, so the weight rows fill the MMA's 64-row side and the tokens its narrow side (where
    torch._scaled_mm pads the tokens to a full tile). xq, xs: the per-token quantization above.
    GROUP > 0 (w8a8-fp8-block): scales per GROUP columns, xs [M, K / GROUP] (strides stride_xs, stride_xsg) and ws
    [N, K / GROUP] (strides stride_ws, stride_wsg); each BLOCK_K chunk (within one group: GROUP % BLOCK_K == 0) is
    scaled by its group's scales on the way into the float32 accumulator."""
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_begin = pid_k * k_per_split
    wait_for_inputs(PDL)
    for k0 in range(k_begin, tl.minimum(k_begin + k_per_split, K), BLOCK_K):
        k_mask = k0 + offs_k < K
        w = tl.load(w_ptr + offs_n[:, None] * K + (k0 + offs_k)[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        xq = tl.load(xq_ptr + offs_m[:, None] * K + (k0 + offs_k)[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if GROUP > 0:
            group = k0 // GROUP
            w_scale = tl.load(ws_ptr + offs_n * stride_ws + group * stride_wsg, mask=n_mask, other=0.0)
            x_scale = tl.load(xs_ptr + offs_m * stride_xs + group * stride_xsg, mask=m_mask, other=0.0)
            acc += tl.dot(w, tl.trans(xq)) * w_scale[:, None] * x_scale[None, :]
        else:
            acc = tl.dot(w, tl.trans(xq), acc)
    if GROUP > 0:
        y = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    else:
        if W_SCALE_PER_ROW:
            w_scale = tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)
        else:
            w_scale = tl.zeros((BLOCK_N,), tl.float32) + tl.load(ws_ptr)
        x_scale = tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)
        y = tl.trans(acc * w_scale[:, None] * x_scale[None, :])  # [BLOCK_M, BLOCK_N]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if IS_SPLIT and SUM_SPLITS > 0:  # the last split of the tile sums them (split_k_triton)
        store_split(y, out_ptr, final_ptr, bias_ptr, counter_ptr, offs_m, offs_n, m_mask, n_mask, stride_om,
                    stride_split, HAS_BIAS, SUM_SPLITS)
    elif IS_SPLIT:
        tl.store(out_ptr + pid_k * stride_split + offs_m[:, None] * stride_om + offs_n[None, :], y, mask=out_mask)
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty), mask=out_mask)


def fp8_linear_small_m(
    x_fp8: Tensor, x_scale: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None, out_dtype: torch.dtype,
    block_n: int = 64, block_k: int = 128, split_k: int = 1, num_warps: int = 4, num_stages: int = 3,
    block_m: int = 16, group_size: int = 0,
) -> Tensor:
    """x_fp8 [M, K] contiguous, x_scale [M, 1] (from quantize_fp8_per_token) → [M, N] in out_dtype:
    the product torch._scaled_mm computes, for a few tokens. group_size > 0 (w8a8-fp8-block): x_scale [M, G]
    and weight_scale [N, G] hold one scale per group_size columns (G = ceil(K / group_size)); block_k is cut
    to divide the group."""
    M, K = x_fp8.shape
    if group_size:
        block_k = math.gcd(block_k, group_size)
    N = weight.shape[0]
    tiles_n, tiles_m = triton.cdiv(N, block_n), triton.cdiv(M, block_m)
    blocks_per_split, split_k, out, target, counters = plan_splits(triton.cdiv(K, block_k), split_k, M, N, x_fp8,
                                                                   out_dtype, tiles_n * tiles_m, block_m)
    k_per_split = blocks_per_split * block_k
    is_split = split_k > 1
    _fp8_small_m_kernel[(tiles_n, split_k, tiles_m)](
        x_fp8, x_scale, weight, weight_scale, bias if bias is not None else weight_scale, target, out,
        counters if counters is not None else out, M, N, K, k_per_split, N if is_split else out.stride(0), M * N,
        x_scale.stride(0), x_scale.stride(-1), weight_scale.stride(0), weight_scale.stride(-1),
        W_SCALE_PER_ROW=weight_scale.numel() > 1, HAS_BIAS=bias is not None, IS_SPLIT=is_split,
        SUM_SPLITS=split_k if counters is not None else 0, GROUP=group_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
        **pdl_args(x_fp8.device),
    )
    finish_splits(target, counters, bias, out)
    return out
