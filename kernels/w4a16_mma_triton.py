"""Triton kernel of the W4A16 GEMM for many tokens (prefill, large decode batches): the weight
dequantized inside the K loop, tensor cores, one accumulator (imported only when it runs).

Same "gpu" weight layout as w4a16_triton.py (qweight [ceil(K / 128) * 16, N] int32, nibble j of
word row r of tile t is input column 128 t + 16 j + r). Per K tile of 128 the program loads one
[16, BLOCK_N] word block and the [BLOCK_M, 128] activation block (both pipelined over num_stages),
unpacks the words into the [128, BLOCK_N] operand in input-column order, and issues one tl.dot
into one accumulator, so the tensor-core calls chain across K as in a dense GEMM. Programs are
ordered in bands of GROUP_M row tiles, so the weight tiles a band reads stay in L2 while its
activation rows are reused.

Two operand kinds (constexpr A_FP8):
  bf16/fp16  b = ((level - z) * s) rounded once to the activation dtype: the very weight the
             dequantize + matmul path multiplies, so only the summation order differs.
  fp8 (W4A8) the activations quantized per token to E4M3 (x = x8 * xs), b = level - z, which is
             exact in E4M3 (|level - z| <= 15); each group's fp32 product is scaled by s on the
             accumulator, the token scale applied once at the end. FP8 tensor cores run at twice
             the 16-bit rate; the activation rounding (3 mantissa bits) is the price. Groups of
             128 columns or more (or per channel) only: one group per K tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.tools.tensor_descriptor import TensorDescriptor

from .w4a16_triton import K_TILE, _group_params


@triton.jit
def _dequant_asm(words, zoff, s, IS_BF16: tl.constexpr):
    """(level - z) * s rounded once to 16 bits, two values per instruction: `words` hold each level in
    their low 4 bits (above: anything); zoff = MAGIC + z and s are in the activation dtype.

    NOTE: prmt gathers two words' low bytes into one register, lop3 keeps the nibbles and ORs in the
    magic exponent (0x4300: bf16 128 + level; 0x6400: fp16 1024 + level), then one packed subtract
    (exact: small integers) and one packed multiply (the single rounding)."""
    if IS_BF16:
        out = tl.inline_asm_elementwise(
            "{ .reg .b32 t; prmt.b32 t, $1, $2, 0x4400; lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA; "
            "sub.rn.bf16x2 t, t, $3; mul.rn.bf16x2 $0, t, $4; }",
            "=r,r,r,r,r", [words, zoff, s], dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        out = tl.inline_asm_elementwise(
            "{ .reg .b32 t; prmt.b32 t, $1, $2, 0x4400; lop3.b32 t, t, 0x000F000F, 0x64006400, 0xEA; "
            "sub.rn.f16x2 t, t, $3; mul.rn.f16x2 $0, t, $4; }",
            "=r,r,r,r,r", [words, zoff, s], dtype=tl.float16, is_pure=True, pack=2)
    return out


@triton.jit
def _w4a16_mma_kernel(
    x_desc, xs_ptr, w_desc, s_ptr, qz_ptr, bias_ptr, out_ptr,
    M, N, num_groups, num_tiles, stride_om,
    GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, A_FP8: tl.constexpr, FAST_CVT: tl.constexpr, IS_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_m, num_pid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    band = pid // (GROUP_M * num_pid_n)
    first_m = band * GROUP_M
    band_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % band_rows
    pid_n = (pid % (GROUP_M * num_pid_n)) // band_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(num_tiles):
        w = w_desc.load([t * 16, pid_n * BLOCK_N])  # [16, BLOCK_N] words; columns past N read 0
        if A_FP8 or GROUP_SIZE >= 128:
            # Tiles past K (padding) meet x = 0: clamping their group keeps the loads in bounds.
            s, z = _group_params(s_ptr, qz_ptr, tl.minimum(t * 128 // GROUP_SIZE, num_groups - 1), offs_n, n_mask,
                                 N, HAS_ZEROS)
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for h in tl.static_range(2):  # the tile's two halves of 64 input columns: nibbles 4 h ... 4 h + 3
            a = x_desc.load([pid_m * BLOCK_M, t * 128 + 64 * h])  # [BLOCK_M, 64]; past M or K reads 0
            shifts = 4 * (4 * h + tl.arange(0, 4))
            # row 16 i + r of the half is nibble 4 h + i of word row r: input column 128 t + 64 h + 16 i + r
            levels = tl.reshape((w[None, :, :] >> shifts[:, None, None]) & 0xF, (64, BLOCK_N))
            magic = (levels | 0x4B000000).to(tl.float32, bitcast=True)  # 2**23 + level, exact
            if A_FP8:
                b = (magic - (8388608.0 + z)[None, :]).to(tl.float8e4nv)  # level - z, exact
                part = tl.dot(a, b, part)
            elif FAST_CVT:
                words = tl.reshape(w[None, :, :] >> shifts[:, None, None], (64, BLOCK_N))
                zoff = tl.broadcast_to(((128.0 if IS_BF16 else 1024.0) + z).to(a.dtype)[None, :], (64, BLOCK_N))
                b = _dequant_asm(words, zoff, tl.broadcast_to(s.to(a.dtype)[None, :], (64, BLOCK_N)), IS_BF16)
                acc = tl.dot(a, b, acc)
            elif GROUP_SIZE >= 128:
                b = ((magic - (8388608.0 + z)[None, :]) * s[None, :]).to(a.dtype)
                acc = tl.dot(a, b, acc)
            else:
                g = tl.minimum((t * 128 + 64 * h + tl.arange(0, 64)) // GROUP_SIZE, num_groups - 1)[:, None]
                s, z = _group_params(s_ptr, qz_ptr, g, offs_n[None, :], n_mask[None, :], N, HAS_ZEROS)  # [64, BLOCK_N]
                b = ((magic - (8388608.0 + z)) * s).to(a.dtype)
                acc = tl.dot(a, b, acc)
        if A_FP8:
            acc += part * s[None, :]
    if A_FP8:
        acc *= tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def launch_w4a16_mma(
    x: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor | None, bias: Tensor | None, group_size: int,
    block_m: int, block_n: int, group_m: int, num_warps: int, num_stages: int, a_fp8: bool = False,
    fast_cvt: bool = False,
) -> Tensor:
    """x [M, K] (unit stride along K) → [M, N] in x's dtype. a_fp8: W4A8 (see the module docstring);
    needs group_size -1 or a multiple of 128."""
    M, K = x.shape
    N = qweight.shape[1]
    num_tiles = qweight.shape[0] // 16
    group_columns = group_size if group_size > 0 else num_tiles * K_TILE
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    x_scale = scales  # unused unless a_fp8
    if a_fp8:
        if group_columns % K_TILE:
            raise ValueError(f"W4A8 needs groups of a multiple of {K_TILE} columns, not {group_size}")
        from .fp8_triton import quantize_fp8_per_token
        from .fp8 import MIN_SCALE

        x, x_scale = quantize_fp8_per_token(x, MIN_SCALE)
    x_desc = TensorDescriptor.from_tensor(x, block_shape=[block_m, 64])
    w_desc = TensorDescriptor.from_tensor(qweight, block_shape=[16, block_n])
    grid = (triton.cdiv(M, block_m) * triton.cdiv(N, block_n),)
    _w4a16_mma_kernel[grid](
        x_desc, x_scale, w_desc, scales, qzeros if qzeros is not None else scales, bias if bias is not None else scales,
        out, M, N, scales.shape[0], num_tiles, out.stride(0),
        GROUP_SIZE=group_columns, HAS_ZEROS=qzeros is not None, HAS_BIAS=bias is not None, A_FP8=a_fp8, FAST_CVT=fast_cvt and not a_fp8 and group_columns >= K_TILE, IS_BF16=x.dtype == torch.bfloat16,
        BLOCK_M=block_m, BLOCK_N=block_n, GROUP_M=group_m, num_warps=num_warps, num_stages=num_stages,
    )
    return out
