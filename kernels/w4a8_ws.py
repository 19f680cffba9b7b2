"""W4A8 on Hopper: int4 weights, FP8 (E4M3) activations, FP8 tensor cores (Gluon, sm_90 only; imported
only when it runs).

The warp-specialized schedule of w4a16_ws (a producer warp streaming the gpu layout's packed words
and the activations by TMA; two consumer warpgroups of 64 weight rows each, the second one tile
behind the first), with the MMA in FP8: twice the tensor-core rate of bf16, for many tokens, where
the W4A16 kernels are compute-bound.
  - (level - zero) is a small integer, exact in E4M3; it is made in the registers of the wgmma A
    operand: MAGIC + level as fp16 pairs (lop3), the fp16 subtract, and cvt.rn.satfinite.e4m3x2.f16x2;
  - the group scale multiplies each tile's fp32 products (one tile of 128 input columns is one group)
    and the token's activation scale the result;
  - the activations are quantized per token (fp8_triton.quantize_fp8_per_token, permute=True) with
    their columns in the order the conversion leaves the weights in, so that no register moves:
    the words of a row land where the A operand wants 4 bytes of 4 consecutive positions, and the
    positions 4 c + e of each 64 hold input column 16 sigma(e) + c of them (word c's nibbles
    sigma(e) or 4 + sigma(e), sigma = (0, 2, 1, 3): the order the conversion's two cvts pack them).
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .pdl_triton import pdl_args
from .split_k_triton import finish_splits, plan_splits
from .w4a16_gemm import WS_BLOCK_N
from .w4a16_gluon import _store_tile
from .w4a16_triton import group_columns_of
from .w4a16_ws import _producer

ROWS = gl.constexpr(WS_BLOCK_N // 2)  # weight rows per consumer warpgroup
# One word's four nibbles (its low 16 bits with selector 0x1100, its high ones with 0x3322) → four
# E4M3 (level - zero) in one register: bytes (nibble 0, 2, 1, 3) of the half. $1 the word, $5 the pair
# (1024 + zero, 1024 + zero) as fp16 bits ($2-$4, $6-$8: the same, one input per packed element).
_CVT_E4M3 = """{
    .reg .b32 u, t, v;
    .reg .b16 lo, hi;
    prmt.b32 u, $1, $1, SELECTOR;
    lop3.b32 t, u, 0x000F000F, 0x64006400, 0xEA;
    shr.u32 v, u, 4;
    lop3.b32 v, v, 0x000F000F, 0x64006400, 0xEA;
    sub.rn.f16x2 t, t, $5;
    sub.rn.f16x2 v, v, $5;
    cvt.rn.satfinite.e4m3x2.f16x2 lo, t;
    cvt.rn.satfinite.e4m3x2.f16x2 hi, v;
    mov.b32 $0, {lo, hi};
}"""
_CVT_LOW = gl.constexpr(_CVT_E4M3.replace("SELECTOR", "0x1100"))
_CVT_HIGH = gl.constexpr(_CVT_E4M3.replace("SELECTOR", "0x3322"))
# The A operand of an m64 x k32 E4M3 wgmma (four warps), for 64 positions (two k32 slices), as
# gl.to_linear_layout gives it for DotOperandLayout(0, mma, k_width=4), and the packed words' layout
# whose every word, four times over (join, reshape), is that: thread (lane 4 i + q) holds words
# q, q + 4, q + 8, q + 12 of rows i and i + 8 (of its warp's 16).
A_POSITIONS = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [8, 0], [0, 16], [0, 32]], lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 64]))
WORDS = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[8, 0], [0, 4], [0, 8]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 16]))


@gluon.jit
def _zero_bits(qz_ptr, t, offs_n, n_mask, N, num_groups, GROUP_SIZE: gl.constexpr, HAS_ZEROS: gl.constexpr):
    """(1024 + zero) as fp16 bits in both halves of an int32 [rows], for the group of K tile t."""
    if HAS_ZEROS:
        g = gl.minimum((t * 128) // GROUP_SIZE, num_groups - 1)
        z_word = gl.load(qz_ptr + g * ((N + 7) // 8) + offs_n // 8, mask=n_mask, other=0)
        half = 0x6400 | ((z_word >> ((offs_n % 8) * 4)) & 0xF)  # 1024 + z as fp16: an exact integer
    else:
        half = gl.full(offs_n.shape, 0x6408, gl.int32, offs_n.type.layout)
    return half | (half << 16)


@gluon.jit
def _half_operand(words4, zero4, a_layout: gl.constexpr, HIGH: gl.constexpr):
    asm: gl.constexpr = _CVT_HIGH if HIGH else _CVT_LOW
    out = gl.inline_asm_elementwise(asm, "=r,r,r,r,r,r,r,r,r", [words4, zero4], dtype=gl.float8e4nv,
                                    is_pure=True, pack=4)
    return gl.convert_layout(out, a_layout)


@gluon.jit
def _tile_operands(words_smem, zero_bits, a_layout: gl.constexpr):
    """One warpgroup's 64 rows of a tile ([16, 64] int32 in shared memory) → the two E4M3 A operands
    [64, 64] of its positions 0-63 and 64-127."""
    words = words_smem.permute((1, 0)).load(WORDS)  # [64, 16]
    pair = gl.join(words, words)
    words4 = gl.convert_layout(gl.reshape(gl.join(pair, pair), [64, 64]), A_POSITIONS)
    zero4 = gl.zeros([64, 64], gl.int32, A_POSITIONS) + zero_bits[:, None]
    return _half_operand(words4, zero4, a_layout, False), _half_operand(words4, zero4, a_layout, True)


@gluon.jit
def _consumer(w_smem, x_smem, ready, empty, s_ptr, qz_ptr, xs_ptr, bias_ptr, out_ptr,
              M, N, num_groups, t_begin, n_tiles, off_m, off_n, pid_k, stride_om, stride_split,
              row0: gl.constexpr, GROUP_SIZE: gl.constexpr, HAS_ZEROS: gl.constexpr, HAS_BIAS: gl.constexpr,
              IS_SPLIT: gl.constexpr, STAGES: gl.constexpr, turn, DIAG: gl.constexpr):
    """One warpgroup: weight rows off_n + row0 ... + 63 of the tile."""
    BLOCK_M: gl.constexpr = x_smem.shape[1]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 32])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=4)
    offs_z = off_n + row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, A_POSITIONS))
    offs_s = off_n + row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma_layout))
    z_mask, s_mask = offs_z < N, offs_s < N
    # the group parameters one tile ahead of their use (a global load's latency hidden)
    zero = _zero_bits(qz_ptr, t_begin, offs_z, z_mask, N, num_groups, GROUP_SIZE, HAS_ZEROS)
    scale = gl.load(s_ptr + gl.minimum((t_begin * 128) // GROUP_SIZE, num_groups - 1) * N + offs_s, mask=s_mask,
                    other=0.0).to(gl.float32)
    acc = gl.zeros((ROWS, BLOCK_M), gl.float32, mma_layout)
    part = gl.zeros((ROWS, BLOCK_M), gl.float32, mma_layout)
    if row0 != 0:  # staggered: the first warpgroup's first wgmmas go into the tensor cores' queue first
        mbarrier.wait(turn, 0)
    for i in range(n_tiles):
        stage = i % STAGES
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        # converted and multiplied in one iteration: an operand carried to the next one is kept as
        # separate bytes and packed again (64 LOP3 + 48 PRMT per tile, sm_90 SASS)
        if DIAG % 2 == 1:
            a0 = gl.full([64, 64], 1.0, gl.float8e4nv, a_layout)
            a1 = a0
        else:
            a0, a1 = _tile_operands(w_smem.index(stage).slice(row0, ROWS, dim=1), zero, a_layout)
        if DIAG >= 2:
            acc = warpgroup_mma(a0, x_smem.index(stage).slice(0, 64, dim=1).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma(a1, x_smem.index(stage).slice(64, 64, dim=1).permute((1, 0)), acc, is_async=True)
        else:
            part = warpgroup_mma(a0, x_smem.index(stage).slice(0, 64, dim=1).permute((1, 0)), part, use_acc=False,
                                 is_async=True)
            part = warpgroup_mma(a1, x_smem.index(stage).slice(64, 64, dim=1).permute((1, 0)), part, is_async=True)
        if row0 == 0:
            if i == 0:
                mbarrier.arrive(turn)
        t_next = t_begin + gl.minimum(i + 1, n_tiles - 1)
        zero = _zero_bits(qz_ptr, t_next, offs_z, z_mask, N, num_groups, GROUP_SIZE, HAS_ZEROS)
        scale_next = gl.load(s_ptr + gl.minimum((t_next * 128) // GROUP_SIZE, num_groups - 1) * N + offs_s,
                             mask=s_mask, other=0.0).to(gl.float32)
        if DIAG >= 2:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(empty.index(stage))
        else:
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
            mbarrier.arrive(empty.index(stage))  # this warpgroup no longer reads the stage
            acc += part * scale[:, None]
        scale = scale_next
    offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma_layout))
    acc = acc * gl.load(xs_ptr + offs_m, mask=offs_m < M, other=0.0)[None, :]
    _store_tile(acc, bias_ptr, out_ptr, out_ptr, out_ptr, M, N, off_m, off_n + row0, pid_k, stride_om,
                stride_split, HAS_BIAS, IS_SPLIT, 0, mma_layout)


@gluon.jit
def _w4a8_ws_kernel(
    x_desc, w_desc, s_ptr, qz_ptr, xs_ptr, bias_ptr, out_ptr,
    M, N, num_groups, num_tiles, tiles_per_split, stride_om, stride_split,
    GROUP_SIZE: gl.constexpr, HAS_ZEROS: gl.constexpr, HAS_BIAS: gl.constexpr, IS_SPLIT: gl.constexpr,
    STAGES: gl.constexpr, PDL: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr,
    DIAG: gl.constexpr = 0,
):
    """out [M, N] (or this K split's fp32 partial) for one [128 weight rows, BLOCK_M tokens] tile."""
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[1]
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    pid_m = gl.program_id(2)
    off_n = pid_n * BLOCK_N
    off_m = pid_m * BLOCK_M
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, 16, BLOCK_N], w_desc.layout)
    x_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_M, 128], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(turn, count=1)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # one arrival per consumer warpgroup
    t_begin = pid_k * tiles_per_split
    n_tiles = gl.minimum(tiles_per_split, num_tiles - t_begin)
    gl.warp_specialize([
        (_consumer, (w_smem, x_smem, ready, empty, s_ptr, qz_ptr, xs_ptr, bias_ptr, out_ptr,
                     M, N, num_groups, t_begin, n_tiles, off_m, off_n, pid_k, stride_om, stride_split,
                     gl.constexpr(0), GROUP_SIZE, HAS_ZEROS, HAS_BIAS, IS_SPLIT, STAGES, turn, DIAG)),
        (_consumer, (w_smem, x_smem, ready, empty, s_ptr, qz_ptr, xs_ptr, bias_ptr, out_ptr,
                     M, N, num_groups, t_begin, n_tiles, off_m, off_n, pid_k, stride_om, stride_split,
                     gl.constexpr(64), GROUP_SIZE, HAS_ZEROS, HAS_BIAS, IS_SPLIT, STAGES, turn, DIAG)),  # ROWS
        (_producer, (x_desc, w_desc, w_smem, x_smem, ready, empty, t_begin, n_tiles, off_m, off_n, STAGES, PDL)),
    ], [4, 1], [CONSUMER_REGS, 40])


def w4a8_stages(block_m: int) -> int:
    """Ring stages that fit beside the kernel's other shared memory: packed words + FP8 activations."""
    return min(8, 200 * 1024 // (16 * WS_BLOCK_N * 4 + block_m * 128))


def launch_w4a8_ws(
    x_fp8: Tensor, x_scale: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor | None, bias: Tensor | None,
    group_size: int, block_m: int, split_k: int, num_stages: int, out_dtype: torch.dtype, diag: int = 0,
) -> Tensor:
    """x_fp8 [M, K] (quantize_fp8_per_token(x, permute=True)), x_scale [M, 1] float32 → [M, N] out_dtype."""
    M = x_fp8.shape[0]
    N = qweight.shape[1]
    num_tiles = qweight.shape[0] // 16
    tiles_per_split, split_k, out, target, counters = plan_splits(num_tiles, split_k, M, N, x_fp8, out_dtype)
    x_layout = gl.NVMMASharedLayout.get_default_for([block_m, 128], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([16, WS_BLOCK_N], gl.int32)
    x_desc = TensorDescriptor(x_fp8, list(x_fp8.shape), list(x_fp8.stride()), [block_m, 128], x_layout)
    w_desc = TensorDescriptor(qweight, list(qweight.shape), list(qweight.stride()), [16, WS_BLOCK_N], w_layout)
    is_split = split_k > 1
    _w4a8_ws_kernel[(triton.cdiv(N, WS_BLOCK_N), split_k, triton.cdiv(M, block_m))](
        x_desc, w_desc, scales, qzeros if qzeros is not None else scales, x_scale,
        bias if bias is not None else scales, target, M, N, scales.shape[0], num_tiles, tiles_per_split,
        N if is_split else out.stride(0), M * N,
        GROUP_SIZE=group_columns_of(group_size, num_tiles), HAS_ZEROS=qzeros is not None, HAS_BIAS=bias is not None,
        IS_SPLIT=is_split, STAGES=num_stages, CONSUMER_REGS=232, num_warps=4, DIAG=diag, **pdl_args(x_fp8.device),
    )
    finish_splits(target, counters, bias, out)
    return out
