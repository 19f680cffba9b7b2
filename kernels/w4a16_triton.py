"""Triton kernels of the W4A16 GEMM (imported only when a kernel runs; see kernels/__init__.py).

Weights are in the "gpu" layout of `w4a16_gemm.pack_w4a16_for_gpu`:
  qweight [ceil(K / 128) * 16, N] int32   K tile t, word row r, nibble j holds k = 128 t + 16 j + r
  scales  [num_groups, N]       x dtype   one scale row per group: contiguous along N
  qzeros  [num_groups, ceil(N / 8)] int32 zero levels, nibble j of word w is column 8 w + j
So a K tile of 128 is one [16, BLOCK_N] int32 load (16-byte loads along N), and nibble j of it is the
[16, BLOCK_N] slice of input columns 128 t + 16 j ... + 15: no reshape is needed to unpack a tile.

Three kernels, chosen per shape by the tuning table (w4a16_gemm.py):
  gemv    a few tokens: CUDA-core FMAs, the unpacked levels never leave registers.
  fused   tensor cores: tl.dot per nibble slice (depth 16) or per group (slices stacked).
  dequant the weight [N, K] in the model dtype, for torch's matmul at large M.

NOTE: the tensor-core dequantization is the "magic number" trick. level | 0x4300 read as bf16 is
128 + level (0x6400 as fp16: 1024 + level), so an operand costs a shift, a mask-or and a register
split, and no int→float conversion. The offset (and the zero point) is taken out once per group:
    sum_k x[k] (level[k] - z) s = s (sum_k x[k] (MAGIC + level[k]) - (MAGIC + z) sum_k x[k]).
The dot products are exact in fp32 (8-bit by 8-bit mantissas), sum_k x[k] is computed alongside.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .pdl_triton import pdl_args, wait_for_inputs
from .split_k_triton import finish_splits, plan_splits, store_split

K_TILE = 128  # input columns per packed tile: 16 word rows x 8 nibbles
PIECE = 16  # input columns per nibble slice of a tile (the depth of one tl.dot)

# (bit pattern OR-ed into each level, its value) per activation dtype; fp32 converts directly.
_MAGIC = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0), torch.float32: (0, 0.0)}
_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _operand(bits16, IS_FP32: tl.constexpr, OP_DTYPE: tl.constexpr):
    """An int32 tensor whose low 16 bits are (MAGIC | level) → the dot operand MAGIC + level."""
    if IS_FP32:
        return bits16.to(tl.float32)
    return bits16.to(tl.int16).to(OP_DTYPE, bitcast=True)


@triton.jit
def _group_params(s_ptr, qz_ptr, g, offs_n, n_mask, N, HAS_ZEROS: tl.constexpr):
    """(scale, zero level) of group g for the columns offs_n, as float32 [BLOCK_N] each; g may be a
    column of groups ([R, 1], with offs_n and n_mask as rows [1, BLOCK_N]) for [R, BLOCK_N] each
    (the symmetric zero stays [1, BLOCK_N])."""
    s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        z_word = tl.load(qz_ptr + g * tl.cdiv(N, 8) + offs_n // 8, mask=n_mask, other=0)
        z = ((z_word >> ((offs_n % 8) * 4)) & 0xF).to(tl.float32)
    else:
        z = tl.full(offs_n.shape, 8.0, tl.float32)
    return s, z


@triton.jit
def _load_x(x_ptr, offs_m, m_mask, k0, K, stride_xm, WIDTH: tl.constexpr):
    offs_k = k0 + tl.arange(0, WIDTH)
    mask = m_mask[:, None] & (offs_k < K)[None, :]
    return tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0)


@triton.jit
def _dot_piece(part, xsum, b, x_ptr, offs_m, m_mask, k0, K, stride_xm, PRECISION: tl.constexpr):
    """part += x[:, k0:k0+16] @ b, xsum += row sums of that x slice."""
    a = _load_x(x_ptr, offs_m, m_mask, k0, K, stride_xm, 16)  # [BLOCK_M, 16]
    part = tl.dot(a, b, part, input_precision=PRECISION)
    xsum += tl.sum(a.to(tl.float32), axis=1)
    return part, xsum


@triton.jit
def _store_result(acc, out_ptr, final_ptr, counter_ptr, bias_ptr, offs_m, offs_n, m_mask, n_mask, pid_k, stride_om,
                  stride_split, HAS_BIAS: tl.constexpr, IS_SPLIT: tl.constexpr, SUM_SPLITS: tl.constexpr):
    """The output tile; or this split's fp32 partial into out_ptr (bias added by the sum of the splits),
    with SUM_SPLITS > 0 the last split of the tile summing them into final_ptr (split_k_triton)."""
    out_mask = m_mask[:, None] & n_mask[None, :]
    if IS_SPLIT:
        if SUM_SPLITS > 0:
            store_split(acc, out_ptr, final_ptr, bias_ptr, counter_ptr, offs_m, offs_n, m_mask, n_mask, stride_om,
                        stride_split, HAS_BIAS, SUM_SPLITS)
        else:
            tl.store(out_ptr + pid_k * stride_split + offs_m[:, None] * stride_om + offs_n[None, :], acc,
                     mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr, qw_ptr, s_ptr, qz_ptr, bias_ptr, out_ptr, final_ptr, counter_ptr,
    M, N, K, num_groups, num_tiles, tiles_per_split,
    stride_xm, stride_om, stride_split,
    GROUP_SIZE: tl.constexpr,  # input columns per group; >= padded K for one group per channel
    PIECES_PER_GROUP: tl.constexpr,  # min(GROUP_SIZE, 128) // 16
    HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, IS_SPLIT: tl.constexpr, SUM_SPLITS: tl.constexpr,
    MAGIC: tl.constexpr, MAGIC_VALUE: tl.constexpr, IS_FP32: tl.constexpr, PRECISION: tl.constexpr,
    IS_STACKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    """Tensor-core path: out[m, n] (or this split's partial) = sum_k x[m, k] w[k, n] over this split's
    K tiles. IS_STACKED: the group's nibble slices are stacked into one [group, BLOCK_N]
    operand (one tl.dot, one layout change); else one tl.dot of depth 16 per slice."""
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    offs_r = tl.arange(0, 16)
    op_dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, num_tiles)
    wait_for_inputs(PDL)
    for t in range(t_begin, t_end):
        w = tl.load(qw_ptr + (t * 16 + offs_r)[:, None] * N + offs_n[None, :], mask=n_mask[None, :], other=0)
        for gi in tl.static_range(8 // PIECES_PER_GROUP):
            k_group = t * 128 + gi * PIECES_PER_GROUP * 16
            # Tiles past K (padding) meet x = 0: clamping their group keeps the loads in bounds.
            g = tl.minimum(k_group // GROUP_SIZE, num_groups - 1)
            s, z = _group_params(s_ptr, qz_ptr, g, offs_n, n_mask, N, HAS_ZEROS)
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            xsum = tl.zeros((BLOCK_M,), dtype=tl.float32)
            if IS_STACKED:
                shifts = 4 * (gi * PIECES_PER_GROUP + tl.arange(0, PIECES_PER_GROUP))
                levels = (w[None, :, :] >> shifts[:, None, None]) & 0xF  # [pieces, 16, BLOCK_N]
                b = _operand(tl.reshape(levels | MAGIC, (PIECES_PER_GROUP * 16, BLOCK_N)), IS_FP32, op_dtype)
                a = _load_x(x_ptr, offs_m, m_mask, k_group, K, stride_xm, PIECES_PER_GROUP * 16)
                part = tl.dot(a, b, part, input_precision=PRECISION)
                xsum += tl.sum(a.to(tl.float32), axis=1)
            elif PIECES_PER_GROUP == 8:
                # One group per tile: nibbles j and j + 4 share one shift and one mask-or.
                for jp in tl.static_range(4):
                    pair = ((w >> (4 * jp)) & 0x000F000F) | (MAGIC | (MAGIC << 16))
                    b_lo = _operand(pair & 0xFFFF, IS_FP32, op_dtype)
                    b_hi = _operand(pair >> 16, IS_FP32, op_dtype)
                    part, xsum = _dot_piece(part, xsum, b_lo, x_ptr, offs_m, m_mask, k_group + 16 * jp, K, stride_xm, PRECISION)
                    part, xsum = _dot_piece(part, xsum, b_hi, x_ptr, offs_m, m_mask, k_group + 16 * (jp + 4), K, stride_xm, PRECISION)
            else:
                for jj in tl.static_range(PIECES_PER_GROUP):
                    j = gi * PIECES_PER_GROUP + jj
                    b = _operand(((w >> (4 * j)) & 0xF) | MAGIC, IS_FP32, op_dtype)
                    part, xsum = _dot_piece(part, xsum, b, x_ptr, offs_m, m_mask, k_group + 16 * jj, K, stride_xm, PRECISION)
            acc += (part - xsum[:, None] * (MAGIC_VALUE + z)[None, :]) * s[None, :]
    _store_result(acc, out_ptr, final_ptr, counter_ptr, bias_ptr, offs_m, offs_n, m_mask, n_mask, pid_k, stride_om,
                  stride_split, HAS_BIAS, IS_SPLIT, SUM_SPLITS)


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, qz_ptr, bias_ptr, out_ptr, final_ptr, counter_ptr,
    M, N, K, num_groups, num_tiles, tiles_per_split,
    stride_xm, stride_om, stride_split,
    GROUP_SIZE: tl.constexpr, PIECES_PER_GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, IS_SPLIT: tl.constexpr, SUM_SPLITS: tl.constexpr,
    IS_STACKED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    """CUDA-core path for a few tokens (decode): no tensor cores, so no operand layout changes.

    NOTE: level | 0x4B000000 read as fp32 is 2**23 + level; one subtraction gives level - zero
    exactly. The accumulator keeps the 16 word rows apart ([BLOCK_M, 16, BLOCK_N]) so the loop
    is pure per-thread FMAs; the rows are summed once, at the end.
    """
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    offs_r = tl.arange(0, 16)
    acc = tl.zeros((BLOCK_M, 16, BLOCK_N), dtype=tl.float32)
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, num_tiles)
    wait_for_inputs(PDL)
    for t in range(t_begin, t_end):
        w = tl.load(qw_ptr + (t * 16 + offs_r)[:, None] * N + offs_n[None, :], mask=n_mask[None, :], other=0)
        for gi in tl.static_range(8 // PIECES_PER_GROUP):
            k_group = t * 128 + gi * PIECES_PER_GROUP * 16
            g = tl.minimum(k_group // GROUP_SIZE, num_groups - 1)
            s, z = _group_params(s_ptr, qz_ptr, g, offs_n, n_mask, N, HAS_ZEROS)
            offset = 8388608.0 + z  # 2**23 + zero
            if IS_STACKED:  # all slices of the group in one broadcast product, x loaded once
                shifts = 4 * (gi * PIECES_PER_GROUP + tl.arange(0, PIECES_PER_GROUP))
                magic = (((w[None, :, :] >> shifts[:, None, None]) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
                values = magic - offset[None, None, :]  # [pieces, 16, BLOCK_N] level - zero, exact
                offs_k = k_group + 16 * tl.arange(0, PIECES_PER_GROUP)[:, None] + offs_r[None, :]  # [pieces, 16]
                x_mask = m_mask[:, None, None] & (offs_k < K)[None, :, :]
                x = tl.load(x_ptr + offs_m[:, None, None] * stride_xm + offs_k[None, :, :], mask=x_mask, other=0.0)
                part = tl.sum(x.to(tl.float32)[:, :, :, None] * values[None, :, :, :], axis=1)  # [BLOCK_M, 16, BLOCK_N]
            else:
                part = tl.zeros((BLOCK_M, 16, BLOCK_N), dtype=tl.float32)
                for jj in tl.static_range(PIECES_PER_GROUP):
                    j = gi * PIECES_PER_GROUP + jj
                    magic = (((w >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
                    value = magic - offset[None, :]  # [16, BLOCK_N] level - zero, exact
                    x = _load_x(x_ptr, offs_m, m_mask, k_group + 16 * jj, K, stride_xm, 16).to(tl.float32)
                    part += x[:, :, None] * value[None, :, :]
            acc += part * s[None, None, :]
    _store_result(tl.sum(acc, axis=1), out_ptr, final_ptr, counter_ptr, bias_ptr, offs_m, offs_n, m_mask, n_mask,
                  pid_k, stride_om, stride_split, HAS_BIAS, IS_SPLIT, SUM_SPLITS)


@triton.jit
def _w4a16_dequant_kernel(
    qw_ptr, s_ptr, qz_ptr, w_ptr, N, K, num_groups,
    GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """w[n, k] = (level - z) * s in the scales' dtype, [N, K] like a dense weight, for one 128-column
    tile and BLOCK_N rows (so the matmul after it is the same cuBLAS call as the bf16 baseline)."""
    t, pid_n = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, 16)
    n_mask = offs_n < N
    w = tl.load(qw_ptr + (t * 16 + offs_r)[:, None] * N + offs_n[None, :], mask=n_mask[None, :], other=0)
    levels = (w[None, :, :] >> (4 * tl.arange(0, 8))[:, None, None]) & 0xF  # [8, 16, BLOCK_N]
    levels = tl.reshape(levels, (128, BLOCK_N)).to(tl.float32)  # row k - 128 t = 16 j + r
    offs_k = t * 128 + tl.arange(0, 128)
    if GROUP_SIZE >= 128:
        s, z = _group_params(s_ptr, qz_ptr, tl.minimum(t * 128 // GROUP_SIZE, num_groups - 1), offs_n, n_mask, N, HAS_ZEROS)
        values = (levels - z[None, :]) * s[None, :]
    else:
        g = tl.minimum(offs_k // GROUP_SIZE, num_groups - 1)[:, None]  # [128, 1]
        s, z = _group_params(s_ptr, qz_ptr, g, offs_n[None, :], n_mask[None, :], N, HAS_ZEROS)
        values = (levels - z) * s
    mask = n_mask[:, None] & (offs_k < K)[None, :]
    out = tl.trans(values.to(w_ptr.dtype.element_ty))  # [BLOCK_N, 128]
    tl.store(w_ptr + offs_n[:, None] * K + offs_k[None, :], out, mask=mask)


def group_columns_of(group_size: int, num_tiles: int) -> int:
    """Input columns per group; one group per channel (-1) spans the padded K."""
    return group_size if group_size > 0 else num_tiles * K_TILE


def launch_w4a16_gemm(
    x: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor | None, bias: Tensor | None, group_size: int,
    kind: str, block_m: int, block_n: int, split_k: int, num_warps: int, num_stages: int, is_stacked: bool = False,
    k_tiles: int = 1,
) -> Tensor:
    """x [M, K] (unit stride along K) → [M, N] in x's dtype; kind "rows", "gemv", "swap" or "fused"
    (see W4A16Config)."""
    M, K = x.shape
    N = qweight.shape[1]
    num_tiles = qweight.shape[0] // 16
    rows = M if kind == "rows" else triton.cdiv(M, block_m)  # the grid's third axis
    tiles_per_split, split_k, out, target, counters = plan_splits(num_tiles, split_k, M, N, x, x.dtype,
                                                                  triton.cdiv(N, block_n) * rows,
                                                                  1 if kind == "rows" else block_m)
    is_split = split_k > 1
    group_columns = group_columns_of(group_size, num_tiles)
    args = (
        x, qweight, scales, qzeros if qzeros is not None else scales, bias if bias is not None else scales,
        target, out, counters if counters is not None else out, M, N, K, scales.shape[0], num_tiles, tiles_per_split,
        x.stride(0), N if is_split else out.stride(0), M * N,
    )
    common = dict(
        GROUP_SIZE=group_columns, PIECES_PER_GROUP=min(group_columns, K_TILE) // PIECE,
        HAS_ZEROS=qzeros is not None, HAS_BIAS=bias is not None, IS_SPLIT=is_split,
        SUM_SPLITS=split_k if counters is not None else 0,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages,
    )
    grid = (triton.cdiv(N, block_n), split_k, rows)
    common.update(pdl_args(x.device))
    if kind == "gemv":
        _w4a16_gemv_kernel[grid](*args, **common, IS_STACKED=is_stacked)
    elif kind == "swap":
        _w4a16_swap_kernel[grid](*args, **common, PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    elif kind == "rows":
        del common["BLOCK_M"]
        _w4a16_gemv_rows_kernel[grid](*args, **common, TILES=k_tiles)
    else:
        magic, magic_value = _MAGIC[x.dtype]
        _w4a16_gemm_kernel[grid](
            *args, **common, MAGIC=magic, MAGIC_VALUE=magic_value, IS_FP32=x.dtype == torch.float32,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32", IS_STACKED=is_stacked,
        )
    finish_splits(target, counters, bias, out)
    return out


def launch_w4a16_dequantize(
    qweight: Tensor, scales: Tensor, qzeros: Tensor | None, in_features: int, group_size: int
) -> Tensor:
    """The weight [N, K] in the scales' dtype (the first half of the dequantize + cuBLAS path)."""
    N = qweight.shape[1]
    num_tiles = qweight.shape[0] // 16
    w = torch.empty(N, in_features, device=qweight.device, dtype=scales.dtype)
    block_n = 64
    _w4a16_dequant_kernel[(num_tiles, triton.cdiv(N, block_n))](
        qweight, scales, qzeros if qzeros is not None else scales, w, N, in_features, scales.shape[0],
        GROUP_SIZE=group_columns_of(group_size, num_tiles), HAS_ZEROS=qzeros is not None, BLOCK_N=block_n,
        num_warps=4,
    )
    return w


@triton.jit
def _w4a16_swap_kernel(
    x_ptr, qw_ptr, s_ptr, qz_ptr, bias_ptr, out_ptr, final_ptr, counter_ptr,
    M, N, K, num_groups, num_tiles, tiles_per_split,
    stride_xm, stride_om, stride_split,
    GROUP_SIZE: tl.constexpr, PIECES_PER_GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, IS_SPLIT: tl.constexpr, SUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    """Tensor cores with the operands swapped: out.T [BLOCK_N, BLOCK_M] = w [BLOCK_N, K] @ x.T, so
    the weight is the dot's A operand, which the MMA reads from registers: the packed words go
    global → shared (pipelined) → registers once, and each nibble slice is unpacked, scaled and
    fed to the MMA in registers. The tokens are the dot's N (16 and up), the weight rows its M.

    NOTE: A = (level - z) * s rounded once to the activation dtype: the same weights as the
    dequantize + matmul path. level | 0x4B000000 read as fp32 is 2**23 + level (no int → float
    conversion)."""
    pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    offs_c = tl.arange(0, 16)
    op_dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, num_tiles)
    wait_for_inputs(PDL)
    for t in range(t_begin, t_end):
        w = tl.load(qw_ptr + (t * 16 + offs_c)[None, :] * N + offs_n[:, None], mask=n_mask[:, None], other=0)
        for j in tl.static_range(8):
            k0 = t * 128 + 16 * j
            if j % PIECES_PER_GROUP == 0:
                g = tl.minimum(k0 // GROUP_SIZE, num_groups - 1)
                s, z = _group_params(s_ptr, qz_ptr, g, offs_n, n_mask, N, HAS_ZEROS)
                offset = 8388608.0 + z  # 2**23 + zero
            magic = (((w >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
            a = ((magic - offset[:, None]) * s[:, None]).to(op_dtype)  # [BLOCK_N, 16]
            x_mask = m_mask[None, :] & (k0 + offs_c < K)[:, None]
            xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + (k0 + offs_c)[:, None], mask=x_mask, other=0.0)
            acc = tl.dot(a, xt, acc, input_precision=PRECISION)  # [BLOCK_N, BLOCK_M]
    _store_result(tl.trans(acc), out_ptr, final_ptr, counter_ptr, bias_ptr, offs_m, offs_n, m_mask, n_mask, pid_k,
                  stride_om, stride_split, HAS_BIAS, IS_SPLIT, SUM_SPLITS)


@triton.jit
def _w4a16_gemv_rows_kernel(
    x_ptr, qw_ptr, s_ptr, qz_ptr, bias_ptr, out_ptr, final_ptr, counter_ptr,
    M, N, K, num_groups, num_tiles, tiles_per_split,
    stride_xm, stride_om, stride_split,
    GROUP_SIZE: tl.constexpr, PIECES_PER_GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, IS_SPLIT: tl.constexpr, SUM_SPLITS: tl.constexpr,
    TILES: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    """One token on CUDA cores, TILES K tiles (16 word rows each) per load: many 16-byte loads in
    flight per thread, the next chunk's loads issued before this chunk's arithmetic."""
    pid_n, pid_k, m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.arange(0, TILES * 16)
    tile_of_row, r_of_row = rows // 16, rows % 16
    acc = tl.zeros((TILES * 16, BLOCK_N), dtype=tl.float32)
    t_begin = pid_k * tiles_per_split
    t_end = tl.minimum(t_begin + tiles_per_split, num_tiles)
    t = t_begin
    w_next = tl.load(qw_ptr + (t * 16 + rows)[:, None] * N + offs_n[None, :],
                     mask=(t + tile_of_row < t_end)[:, None] & n_mask[None, :], other=0)
    wait_for_inputs(PDL)  # the first chunk of packed words is on its way meanwhile
    while t < t_end:
        w = w_next
        t_next = t + TILES
        w_next = tl.load(qw_ptr + (t_next * 16 + rows)[:, None] * N + offs_n[None, :],
                         mask=(t_next + tile_of_row < t_end)[:, None] & n_mask[None, :], other=0)
        row_valid = t + tile_of_row < t_end
        for j in tl.static_range(8):
            k = (t + tile_of_row) * 128 + 16 * j + r_of_row  # [TILES * 16] input column of each row
            if j % PIECES_PER_GROUP == 0:
                g = tl.minimum(k // GROUP_SIZE, num_groups - 1)[:, None]
                s, z = _group_params(s_ptr, qz_ptr, g, offs_n[None, :], n_mask[None, :], N, HAS_ZEROS)
                offset = 8388608.0 + z  # 2**23 + zero
                part = tl.zeros((TILES * 16, BLOCK_N), dtype=tl.float32)
            x = tl.load(x_ptr + m * stride_xm + k, mask=row_valid & (k < K), other=0.0).to(tl.float32)
            magic = (((w >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
            part += x[:, None] * (magic - offset)
            if j % PIECES_PER_GROUP == PIECES_PER_GROUP - 1:
                acc += part * s
        t = t_next
    offs_m = m + tl.arange(0, 1)
    _store_result(tl.sum(acc, axis=0)[None, :], out_ptr, final_ptr, counter_ptr, bias_ptr, offs_m, offs_n, offs_m < M,
                  n_mask, pid_k, stride_om, stride_split, HAS_BIAS, IS_SPLIT, SUM_SPLITS)
