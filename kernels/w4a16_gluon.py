"""W4A16 on Hopper's tensor cores with the int4 conversion overlapped with the MMA (Gluon, sm_90 only;
imported only when the dispatch picks kind "wgmma" on a Hopper GPU).

The plain-Triton "swap" kernel (w4a16_triton.py) computes the same product, but Triton lowers a dot
whose operand was computed in registers to: convert → wgmma → wait for it → next convert, so the
conversion and the tensor cores take turns (benchmarks/RESULTS.md, sessions 3 and 7). Gluon says
what runs when:
  - the packed words ([16, BLOCK_N] int32 per 128 input columns, the gpu layout of w4a16_gemm.py)
    and the activations ([BLOCK_M, 64] bf16/fp16, twice per tile, 128-byte swizzle) come in by TMA
    into a ring of STAGES buffers, one mbarrier per stage;
  - each 16-column nibble slice is unpacked in the registers of the wgmma A operand
    (out.T [BLOCK_N, BLOCK_M] = w [BLOCK_N, K] @ x.T: the weight rows are the MMA's M, the tokens
    its N) and multiplied by an asynchronous wgmma with the activations' 16 columns from shared
    memory, in one of two orders (`PER_TILE`, chosen per shape by the tuning table);
  - a stage is refilled once every warp is past the wait that retires the last wgmma reading it.
The weight operand is ((level - zero) * scale) rounded once to the activation dtype, as in the
dequantize + matmul path and the swap kernel (level | 0x4B000000 read as fp32 is 2**23 + level);
with SCALE_ACC (few tokens) it is the exact (level - zero) and the scale multiplies each tile's fp32
products instead (no rounding of the dequantized weight: closer to the float64 product, not the same
bits as the other kernels); those group scales then come by TMA into the stage with the tile's words
(SCALE_RING: a global load per tile cost a one-token gate_up 10%, benchmarks/RESULTS.md session 22).
Group sizes are multiples of 128 (one group per tile) or one group per channel; the dispatch keeps
smaller groups, other GPUs and fp32 on the other kernels (w4a16_gemm.wgmma_supported).
SILU_MUL: the weight is a gate_up in activation's interleaved row order, and the finished tiles go
out as SiLU(gate) · up (`_silu_mul_store`, w4a16_gemm.w4a16_silu_mul); such a kernel lets the next
one (down) launch after its K loop rather than at its start.
"""

from __future__ import annotations

import functools

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from .activation import GATE_UP_INTERLEAVE, silu_and_mul
from .pdl_triton import pdl_args
from .split_k_triton import finish_splits, plan_splits
from .w4a16_triton import group_columns_of

# A SiLU · mul GEMV (gate_up) lets the next kernel (down) launch after its K loop, not at its start (PDL)
SILU_MUL_LATE_DEPENDENTS = True
# The per-tile order with the scale on the products brings each tile's group scales by TMA with its words
# (`SCALE_RING`); False: loaded from global memory one tile ahead, as before (benchmarks/w4a16_scale_ring_probe.py)
SCALE_RING = True
# With SCALE_RING, the zero points' packed words come by TMA too (`ZERO_RING`); False: global loads one tile ahead
ZERO_RING = True
# The per-tile order with scaled operands (no SCALE_ACC) on one warpgroup (4 warps): the operands of a tile's
# in-flight wgmmas read once more after the wait, so that ptxas gives the next tile's registers of their own
# (_after_wait). Measured (benchmarks/RESULTS.md session 24): 3-7% faster there; about even with two
# warpgroups (each converts while the other's wgmmas run anyway), and 1-26% slower in the SCALE_ACC order
# and in the warp-specialized kernel, which therefore do not take it.
LIVE_OPERANDS = True
X_BOX_K = 64  # activation columns per TMA box: 128 bytes, the widest swizzle (16 columns: 1.5x slower)
# triton 3.6 (the GPU machine) names the TMA load async_copy_global_to_shared; later ones async_load
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # (3.6: thread_barrier)
# One pair of weights (_operand): $1, $2 the words of input columns k and k + 1; $5 the prmt selector
# (their low or high 16-bit halves side by side), $7 the nibble's shift within a half; $3, $4 the pair
# (MAGIC + zero, MAGIC + zero) and (scale, scale); $6, $8 repeat $5, $7 (every input comes per element).
_CVT_BF16 = gl.constexpr("""{
    .reg .b32 t;
    prmt.b32 t, $1, $2, $5;
    shr.u32 t, t, $7;
    lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;
    sub.rn.bf16x2 t, t, $3;
    mul.rn.bf16x2 $0, t, $4;
}""")
# The same without the multiply: (level - zero) exact ($3 the offset pair, $4/$5 the selector, $6/$7 the shift).
_CVT_BF16_EXACT = gl.constexpr("""{
    .reg .b32 t;
    prmt.b32 t, $1, $2, $4;
    shr.u32 t, t, $6;
    lop3.b32 t, t, 0x000F000F, 0x43004300, 0xEA;
    sub.rn.bf16x2 $0, t, $3;
}""")
_CVT_FP16_EXACT = gl.constexpr(_CVT_BF16_EXACT.value.replace("0x43004300", "0x64006400").replace("bf16x2", "f16x2"))
_CVT_FP16 = gl.constexpr(_CVT_BF16.value.replace("0x43004300", "0x64006400").replace("bf16x2", "f16x2"))
_GL_DTYPE = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@gluon.jit
def _load_words(x_desc, w_desc, w_smem, bars, stage, t, off_n, sc=None):
    """Tile t's packed words into `stage`; its mbarrier expects them and the two activation boxes.
    sc (SCALE_RING: the scales' descriptor and ring, the zero words' descriptor and ring, N, num_groups,
    GROUP_SIZE, and whether there are zero words): the tile's group scales (and zero words) too, by TMA
    into the stage's slot of each ring."""
    bar = bars.index(stage)
    if sc is None:
        mbarrier.expect(bar, w_desc.block_type.nbytes + 2 * x_desc.block_type.nbytes)
    else:
        s_desc, s_smem, z_desc, z_smem, N, num_groups, GROUP_SIZE, ZEROS = sc
        g = gl.minimum((t * 128) // GROUP_SIZE, num_groups - 1)
        # (ZEROS reaches here as a constant i1 with triton 3.6, not a constexpr: both branches are traced, and
        # the compiler folds the one not taken)
        if not ZEROS:
            mbarrier.expect(bar, w_desc.block_type.nbytes + 2 * x_desc.block_type.nbytes + s_desc.block_type.nbytes)
        else:
            mbarrier.expect(bar, w_desc.block_type.nbytes + 2 * x_desc.block_type.nbytes + s_desc.block_type.nbytes
                            + z_desc.block_type.nbytes)
            _tma_load(z_desc, [g * ((N + 7) // 8) + off_n // 8], bar,
                      z_smem.index(stage).slice(0, z_desc.block_type.shape[0]))
        _tma_load(s_desc, [g * N + off_n], bar, s_smem.index(stage))
    _tma_load(w_desc, [t * 16, off_n], bar, w_smem.index(stage))


@gluon.jit
def _load_x(x_desc, x_smem, bars, stage, t, off_m):
    """Tile t's two activation boxes into `stage` (after _load_words, on the same mbarrier)."""
    bar = bars.index(stage)
    _tma_load(x_desc, [off_m, t * 128], bar, x_smem.index(2 * stage))
    _tma_load(x_desc, [off_m, t * 128 + 64], bar, x_smem.index(2 * stage + 1))


@gluon.jit
def _load_tile(x_desc, w_desc, w_smem, x_smem, bars, stage, t, off_m, off_n, sc=None):
    _load_words(x_desc, w_desc, w_smem, bars, stage, t, off_n, sc)
    _load_x(x_desc, x_smem, bars, stage, t, off_m)


@gluon.jit
def _wait_for_inputs(PDL: gl.constexpr, LAUNCH_DEPENDENTS: gl.constexpr = True):
    """kernels/pdl_triton.wait_for_inputs, in Gluon (a Gluon kernel calls only Gluon functions);
    LAUNCH_DEPENDENTS False: the kernel lets the next one launch later itself (gdc_launch_dependents)."""
    if PDL:
        gdc_wait()
        if LAUNCH_DEPENDENTS:
            gdc_launch_dependents()


@gluon.jit
def _load_prologue(x_desc, w_desc, w_smem, x_smem, bars, t_begin, n_tiles, off_m, off_n, COUNT: gl.constexpr,
                   PDL: gl.constexpr, LAUNCH_DEPENDENTS: gl.constexpr = True, sc=None):
    """The first COUNT tiles (of n_tiles) into stages 0 ... COUNT - 1: their packed words (and sc: group
    scales) before the wait for the kernel that writes the activations (PDL: weights only), the
    activations after it."""
    for s in gl.static_range(COUNT):
        if s < n_tiles:
            _load_words(x_desc, w_desc, w_smem, bars, s, t_begin + s, off_n, sc)
    _wait_for_inputs(PDL, LAUNCH_DEPENDENTS)
    for s in gl.static_range(COUNT):
        if s < n_tiles:
            _load_x(x_desc, x_smem, bars, s, t_begin + s, off_m)


@gluon.jit
def _group_params(s_ptr, qz_ptr, t, offs_n, n_mask, N, num_groups, GROUP_SIZE: gl.constexpr,
                  HAS_ZEROS: gl.constexpr, MAGIC: gl.constexpr):
    """(scale, MAGIC + zero) as fp32 [BLOCK_N] for the group of K tile t."""
    g = gl.minimum((t * 128) // GROUP_SIZE, num_groups - 1)
    s = gl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(gl.float32)
    if HAS_ZEROS:
        z_word = gl.load(qz_ptr + g * ((N + 7) // 8) + offs_n // 8, mask=n_mask, other=0)
        z = ((z_word >> ((offs_n % 8) * 4)) & 0xF).to(gl.float32)
    else:
        z = gl.full(offs_n.shape, 8.0, gl.float32, offs_n.type.layout)
    return s, MAGIC + z


@gluon.jit
def _ring_offset(z_smem, stage, rows, MAGIC: gl.constexpr):
    """MAGIC + zero as fp32 [BLOCK_N], in the layout of `rows` (0 ... BLOCK_N - 1), from the stage's packed
    zero words [BLOCK_N / 8] (nibble j of word w: row 8 w + j). rows seen as [BLOCK_N / 8, 8] keeps each
    element where it is; its words, loaded in that layout's slice, are broadcast along the 8, shifted, and
    seen as [BLOCK_N] again: every thread reads the words of its own rows, and no data moves between threads."""
    BLOCK_N: gl.constexpr = rows.shape[0]
    by_word = gl.reshape(rows, [BLOCK_N // 8, 8])
    words = z_smem.index(stage).slice(0, BLOCK_N // 8).load(gl.SliceLayout(1, by_word.type.layout))
    zeros = (words[:, None] >> ((by_word % 8) * 4)) & 0xF
    zeros = gl.convert_layout(gl.reshape(zeros, [BLOCK_N]), rows.type.layout, assert_trivial=True)
    return MAGIC + zeros.to(gl.float32)


@gluon.jit
def _operand(words, j: gl.constexpr, offset, scale, dtype: gl.constexpr, SCALED: gl.constexpr = 1):
    """Nibble slice j of the words [BLOCK_N, 16] → ((level - zero) * scale) in dtype, A operand layout.

    Two weights per instruction sequence, in 16-bit pairs: the A operand layout keeps input columns
    (k, k + 1) of a row in one thread, as consecutive elements, i.e. words r and r + 1 of the tile;
    prmt puts their 16-bit halves side by side, a shift and a lop3 make MAGIC + level in each half
    (0x4300 | level is 128 + level as bf16, 0x6400 | level 1024 + level as fp16), and the paired
    subtract and multiply give (level - zero) * scale, rounded once, as the fp32 path does: the
    difference is an exact small integer, its product with the scale exact before the rounding.
    SCALED 0: the subtract only, (level - zero) exact; the caller scales the products."""
    selector = gl.zeros_like(words) + (0x5410 + (j // 4) * (0x7632 - 0x5410))
    shift = gl.zeros_like(words) + 4 * (j % 4)
    if SCALED == 0:  # (level - zero) exact, the scale applied to the tile's products
        exact_asm: gl.constexpr = _CVT_BF16_EXACT if dtype == gl.bfloat16 else _CVT_FP16_EXACT
        args = [words, offset.to(dtype)[:, None], selector, shift]
        out = gl.inline_asm_elementwise(exact_asm, "=r,r,r,r,r,r,r,r", args, dtype=dtype.value, is_pure=True, pack=2)
    else:
        scaled_asm: gl.constexpr = _CVT_BF16 if dtype == gl.bfloat16 else _CVT_FP16
        args = [words, offset.to(dtype)[:, None], scale.to(dtype)[:, None], selector, shift]
        out = gl.inline_asm_elementwise(scaled_asm, "=r,r,r,r,r,r,r,r,r", args, dtype=dtype.value, is_pure=True,
                                        pack=2)
    return out


@gluon.jit
def _after_wait(a_next, a, keep):
    """a_next, read together with a after the wgmma wait: so that ptxas keeps the registers of the
    in-flight wgmmas' operands (a) live while a_next is converted and gives a_next registers of its
    own. Without a use after the wait ptxas reuses a's registers for a_next, and so puts the whole
    conversion behind the wait (sm_90 SASS, triton 3.6 and 3.9): the tile's wgmmas and the next tile's
    conversion take turns. One lop3 per operand register: keep (all ones, unknown to the compilers)
    ? a_next : a. ptxas then schedules about a quarter to a half of the conversion before the wait."""
    return (_select(a_next[0], a[0], keep), _select(a_next[1], a[1], keep), _select(a_next[2], a[2], keep),
            _select(a_next[3], a[3], keep), _select(a_next[4], a[4], keep), _select(a_next[5], a[5], keep),
            _select(a_next[6], a[6], keep), _select(a_next[7], a[7], keep))


@gluon.jit
def _select(x, y, keep):
    mask = gl.full(x.shape, 0, gl.int32, x.type.layout) + keep
    return gl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0xE4;", "=r,r,r,r,r", [x, y, mask], dtype=x.dtype,
                                     is_pure=True, pack=2)


@gluon.jit
def _x_slice(x_smem, stage, j: gl.constexpr):
    """Input columns 16 j ... 16 j + 15 of the stage's activations as the B operand [16, BLOCK_M]."""
    return x_smem.index(2 * stage + j // 4).slice(16 * (j % 4), 16, dim=1).permute((1, 0))


@gluon.jit
def _tile_operands(words_smem, offset, scale, a_layout: gl.constexpr, dtype: gl.constexpr, SCALED: gl.constexpr = 1):
    """A tile's eight operands from its packed words in shared memory ([16, rows] int32: a stage, or
    one warpgroup's rows of it); SCALED 0: (level - zero) exact, the scale left to the caller."""
    words = words_smem.permute((1, 0)).load(a_layout)  # [rows, 16] int32
    return (_operand(words, 0, offset, scale, dtype, SCALED), _operand(words, 1, offset, scale, dtype, SCALED),
            _operand(words, 2, offset, scale, dtype, SCALED), _operand(words, 3, offset, scale, dtype, SCALED),
            _operand(words, 4, offset, scale, dtype, SCALED), _operand(words, 5, offset, scale, dtype, SCALED),
            _operand(words, 6, offset, scale, dtype, SCALED), _operand(words, 7, offset, scale, dtype, SCALED))


@gluon.jit
def _tile_mmas(a, x_smem, stage, part):
    """A tile's eight asynchronous wgmmas into a fresh `part` (its products only)."""
    part = warpgroup_mma(a[0], _x_slice(x_smem, stage, 0), part, use_acc=False, is_async=True)
    for j in gl.static_range(1, 8):
        part = warpgroup_mma(a[j], _x_slice(x_smem, stage, j), part, is_async=True)
    return part


@gluon.jit
def _next_tile_operands(w_smem, bars, s_ptr, qz_ptr, t_begin, i_next, n_tiles, offs_n, n_mask, N, num_groups, scale,
                        offset, a_layout: gl.constexpr, dtype: gl.constexpr, GROUP_SIZE: gl.constexpr,
                        HAS_ZEROS: gl.constexpr, MAGIC: gl.constexpr, STAGES: gl.constexpr, SCALED: gl.constexpr,
                        zr=None):
    """The per-tile orders' step while a tile multiplies: tile i_next's operands, once its stage has
    landed, with the group parameters loaded one tile ahead (scale, offset), and the parameters of the
    tile after it requested now (returned for the next call). zr (the zero ring: its shared memory and
    the tile's rows 0 ... BLOCK_N - 1; the caller then passes HAS_ZEROS False): the zero points come with
    the words, from the stage."""
    scale_after, offset_after = _group_params(s_ptr, qz_ptr, t_begin + gl.minimum(i_next + 1, n_tiles - 1), offs_n,
                                              n_mask, N, num_groups, GROUP_SIZE, HAS_ZEROS, MAGIC)
    mbarrier.wait(bars.index(i_next % STAGES), (i_next // STAGES) & 1)
    if zr is not None:
        z_smem, rows = zr
        offset = _ring_offset(z_smem, i_next % STAGES, rows, MAGIC)
    return (_tile_operands(w_smem.index(i_next % STAGES), offset, scale, a_layout, dtype, SCALED), scale_after,
            offset_after)


@gluon.jit
def _refill_stage(x_desc, w_desc, w_smem, x_smem, bars, stage, i, n_tiles, t_begin, off_m, off_n,
                  STAGES: gl.constexpr, sc=None):
    """Tile i's stage refilled with tile i + STAGES once every warp is past the wait for tile i's wgmmas."""
    _cta_barrier()  # no warp still reads this stage
    if i + STAGES < n_tiles:
        _load_tile(x_desc, w_desc, w_smem, x_smem, bars, stage, t_begin + i + STAGES, off_m, off_n, sc)


@gluon.jit
def _silu_mul_store(tile, out_ptr, M, N, off_m, off_n, mma_layout: gl.constexpr):
    """SiLU(gate) · up of an fp32 tile [BLOCK_N, BLOCK_M] of a gate_up whose rows alternate in runs of 8
    (activation.GATE_UP_INTERLEAVE: rows 16 q ... 16 q + 7 gate, the next 8 the same features' up) into
    out [M, N / 2] (contiguous). In the wgmma accumulator a thread holds rows r and r + 8 of its warp's
    16, so each pair meets in one thread: the reshape and split move no data. gate and up are rounded
    to out's dtype first, and the rest is activation_triton's expression: the same bits as storing the
    tile and running that kernel."""
    BLOCK_N: gl.constexpr = tile.shape[0]
    BLOCK_M: gl.constexpr = tile.shape[1]
    offs_on = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma_layout))
    offs_om = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma_layout))
    half = (offs_on // 16) * 8 + offs_on % 8  # the output column of row and of its partner
    ptrs = offs_om[None, :] * (N // 2) + half[:, None]
    # (16-row pairs, gate | up, 8, tokens) → gate | up last, split into the two halves
    gate, up = gl.split(tile.reshape([BLOCK_N // 16, 2, 8, BLOCK_M]).permute((0, 2, 3, 1)))
    ptrs, _ = gl.split(ptrs.reshape([BLOCK_N // 16, 2, 8, BLOCK_M]).permute((0, 2, 3, 1)))
    tokens, _ = gl.split((offs_om[None, :] + 0 * half[:, None]).reshape([BLOCK_N // 16, 2, 8, BLOCK_M])
                         .permute((0, 2, 3, 1)))
    dtype: gl.constexpr = out_ptr.dtype.element_ty
    gate = gate.to(dtype).to(gl.float32)
    up = up.to(dtype).to(gl.float32)
    silu = (gate / (1.0 + gl.exp(-gate))).to(dtype).to(gl.float32)
    # every row of a tile is inside N (the interleave needs N a multiple of 16 and so are the tiles)
    gl.store(out_ptr + ptrs, (silu * up).to(dtype), mask=tokens < M)


@gluon.jit
def _add_bias(acc, bias_ptr, N, off_n, HAS_BIAS: gl.constexpr, mma_layout: gl.constexpr):
    """(acc [rows, tokens] fp32 plus the bias of rows off_n ... where HAS_BIAS, the rows' indices)."""
    offs_on = off_n + gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, mma_layout))
    if HAS_BIAS:
        acc += gl.load(bias_ptr + offs_on, mask=offs_on < N, other=0.0).to(gl.float32)[:, None]
    return acc, offs_on


@gluon.jit
def _finish_tile(acc, bias_ptr, out_ptr, M, N, off_m, off_n, stride_om, HAS_BIAS: gl.constexpr,
                 SILU_MUL: gl.constexpr, mma_layout: gl.constexpr):
    """A whole tile's sum [BLOCK_N, BLOCK_M] fp32: bias added, stored into out [M, N] (row stride
    stride_om), or with SILU_MUL SiLU(gate) · up into out [M, N / 2] (_silu_mul_store)."""
    BLOCK_M: gl.constexpr = acc.shape[1]
    acc, offs_on = _add_bias(acc, bias_ptr, N, off_n, HAS_BIAS, mma_layout)
    if SILU_MUL:
        _silu_mul_store(acc, out_ptr, M, N, off_m, off_n, mma_layout)
    else:
        offs_om = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma_layout))
        mask = (offs_on < N)[:, None] & (offs_om < M)[None, :]
        gl.store(out_ptr + offs_om[None, :] * stride_om + offs_on[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)


@gluon.jit
def _store_tile(acc, bias_ptr, out_ptr, final_ptr, counter_ptr, M, N, off_m, off_n, pid_k, stride_om, stride_split,
                HAS_BIAS: gl.constexpr, IS_SPLIT: gl.constexpr, SUM_SPLITS: gl.constexpr,
                mma_layout: gl.constexpr, SILU_MUL: gl.constexpr = False):
    """The tile's out.T [BLOCK_N, BLOCK_M] into out [M, N] (bias added), or this K split's fp32 partial
    (the last split of the tile to arrive sums them, as split_k_triton.store_split does). SILU_MUL:
    the finished tile goes out as SiLU(gate) · up (_finish_tile); a split kernel that does not sum its
    splits leaves that to its launcher."""
    BLOCK_N: gl.constexpr = acc.shape[0]
    BLOCK_M: gl.constexpr = acc.shape[1]
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(2)
    if IS_SPLIT:
        offs_on = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma_layout))
        offs_om = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma_layout))
        mask = (offs_on < N)[:, None] & (offs_om < M)[None, :]
        ptrs = offs_om[None, :] * stride_om + offs_on[:, None]
        gl.store(out_ptr + pid_k * stride_split + ptrs, acc, mask=mask)
        if SUM_SPLITS > 0:  # the last split of this tile to arrive sums them (split_k_triton.store_split)
            _cta_barrier()  # every thread's partial is stored before the count is released
            tile = pid_m * gl.num_programs(0) + pid_n
            arrived = gl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SUM_SPLITS - 1:
                total = gl.zeros((BLOCK_N, BLOCK_M), gl.float32, mma_layout)
                for split in gl.static_range(SUM_SPLITS):  # unrolled: all the loads in flight at once
                    total += gl.load(out_ptr + split * stride_split + ptrs, mask=mask, other=0.0, cache_modifier=".cg")
                _finish_tile(total, bias_ptr, final_ptr, M, N, off_m, off_n, stride_om, HAS_BIAS, SILU_MUL,
                             mma_layout)
                gl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")
    else:
        _finish_tile(acc, bias_ptr, out_ptr, M, N, off_m, off_n, stride_om, HAS_BIAS, SILU_MUL, mma_layout)


@gluon.jit
def _w4a16_wgmma_kernel(
    x_desc, w_desc, s_ptr, qz_ptr, bias_ptr, out_ptr, final_ptr, counter_ptr, s_desc, z_desc,
    M, N, num_groups, num_tiles, tiles_per_split, stride_om, stride_split,
    GROUP_SIZE: gl.constexpr, HAS_ZEROS: gl.constexpr, HAS_BIAS: gl.constexpr, IS_SPLIT: gl.constexpr,
    SUM_SPLITS: gl.constexpr,
    STAGES: gl.constexpr, PER_TILE: gl.constexpr, SCALE_ACC: gl.constexpr, PDL: gl.constexpr,
    num_warps: gl.constexpr, SILU_MUL: gl.constexpr = False, SILU_MUL_LATE_DEPENDENTS: gl.constexpr = True,
    SCALE_RING: gl.constexpr = False, ZERO_RING: gl.constexpr = False, LIVE_OPERANDS: gl.constexpr = False,
):
    """out [M, N] (or this K split's fp32 partial) for one [BLOCK_N weight rows, BLOCK_M tokens] tile.

    PER_TILE False: each slice is converted while the previous slice's wgmma runs (ptxas then
    serializes the wgmmas themselves: "non wgmma instructions defining input registers").
    PER_TILE True: the next tile's eight operands are converted after this tile's eight wgmmas are
    issued back to back. ptxas gives them the registers of this tile's operands, which it counts as
    free once the wgmmas are issued, and so converts them behind the wait for those wgmmas; with
    LIVE_OPERANDS (set by the launcher in this order on 4 warps without SCALE_ACC) the old operands
    are read once more after the wait (_after_wait) and part of the conversion runs beside the wgmmas.
    SCALE_ACC (per tile only): the operands are (level - zero), exact, and each tile's products go
    to a fresh accumulator that is scaled into the total after the tile's wait: one multiply per
    output element and tile instead of one per weight pair, and the last tile is not converted
    twice (with 4-stage rings, the table's one-token GEMVs 7-11% faster on an H100, session 18).

    Launched with PDL, the first tiles' packed words and group parameters are requested before the
    wait for the kernel that writes the activations (they are weights), so a decode GEMV streams
    its weights while the norm or attention before it finishes."""
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[1]
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    dtype: gl.constexpr = x_desc.dtype
    MAGIC: gl.constexpr = 128.0 if dtype == gl.bfloat16 else 1024.0
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    pid_m = gl.program_id(2)
    off_n = pid_n * BLOCK_N
    off_m = pid_m * BLOCK_M

    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    row_layout: gl.constexpr = gl.SliceLayout(1, a_layout)

    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, 16, BLOCK_N], w_desc.layout)
    x_smem = gl.allocate_shared_memory(dtype, [2 * STAGES, BLOCK_M, 64], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)

    t_begin = pid_k * tiles_per_split
    n_tiles = gl.minimum(tiles_per_split, num_tiles - t_begin)
    offs_n = off_n + gl.arange(0, BLOCK_N, layout=row_layout)
    n_mask = offs_n < N
    # the zero points come by global loads, or with the scale ring from each tile's stage (_ring_offset)
    ZERO_LOADS: gl.constexpr = HAS_ZEROS and not ZERO_RING
    scale, offset = _group_params(s_ptr, qz_ptr, t_begin, offs_n, n_mask, N, num_groups, GROUP_SIZE, ZERO_LOADS, MAGIC)
    acc = gl.zeros((BLOCK_N, BLOCK_M), gl.float32, mma_layout)
    # per tile: all STAGES buffers filled up front; per slice: STAGES - 1 tiles in flight
    PROLOGUE: gl.constexpr = STAGES if PER_TILE else STAGES - 1
    # the down GEMV after a SiLU · mul one is as large: launched while this one runs, it would take the
    # SMs' free slots unevenly (benchmarks/RESULTS.md, session 21), so it may launch once the K loop is done
    LATE_DEPENDENTS: gl.constexpr = SILU_MUL and SILU_MUL_LATE_DEPENDENTS
    zr = None
    sc = None
    if SCALE_RING:
        s_smem = gl.allocate_shared_memory(s_desc.dtype, [STAGES, BLOCK_N], s_desc.layout)
        if ZERO_RING:  # the packed zero words [BLOCK_N / 8] of each tile's group, in the ring too; each
            # stage's slot 128 bytes (a TMA destination's alignment), the words at its start
            Z_SLOT: gl.constexpr = 32 if BLOCK_N <= 256 else BLOCK_N // 8
            z_smem = gl.allocate_shared_memory(gl.int32, [STAGES, Z_SLOT], z_desc.layout)
            zr = (z_smem, gl.arange(0, BLOCK_N, layout=row_layout))
            sc = (s_desc, s_smem, z_desc, z_smem, N, num_groups, GROUP_SIZE, gl.constexpr(True))
        else:  # (no None inside a tuple argument: triton 3.6 cannot test it)
            sc = (s_desc, s_smem, s_desc, s_smem, N, num_groups, GROUP_SIZE, gl.constexpr(False))
    _load_prologue(x_desc, w_desc, w_smem, x_smem, bars, t_begin, n_tiles, off_m, off_n, PROLOGUE, PDL,
                   not LATE_DEPENDENTS, sc)
    if PER_TILE and SCALE_ACC:
        # the operands are (level - zero), exact; each tile's products are scaled into acc after its wait;
        # the last tile is peeled off the loop (no next tile to convert). SCALE_RING: each tile's group
        # scales come with its words, by TMA into the stage (s_desc: the scales [G, N] seen flat);
        # else they are loaded from global memory one tile ahead of their use.
        acc_rows: gl.constexpr = gl.SliceLayout(1, mma_layout)
        offs_n_acc = off_n + gl.arange(0, BLOCK_N, layout=acc_rows)
        n_mask_acc = offs_n_acc < N
        mbarrier.wait(bars.index(0), 0)
        if zr is not None:
            offset = _ring_offset(zr[0], 0, zr[1], MAGIC)
        a = _tile_operands(w_smem.index(0), offset, scale, a_layout, dtype, 0)
        scale_acc, _ = _group_params(s_ptr, qz_ptr, t_begin, offs_n_acc, n_mask_acc, N, num_groups, GROUP_SIZE,
                                     False, MAGIC)
        scale, offset = _group_params(s_ptr, qz_ptr, t_begin + gl.minimum(1, n_tiles - 1), offs_n, n_mask, N,
                                      num_groups, GROUP_SIZE, ZERO_LOADS, MAGIC)
        part = gl.zeros((BLOCK_N, BLOCK_M), gl.float32, mma_layout)
        for i in range(n_tiles - 1):
            stage = i % STAGES
            part = _tile_mmas(a, x_smem, stage, part)
            if SCALE_RING:  # this tile's, from its stage
                scale_acc = s_smem.index(stage).load(acc_rows).to(gl.float32)
            else:  # the next tile's, requested now
                scale_acc_next, _ = _group_params(s_ptr, qz_ptr, t_begin + i + 1, offs_n_acc, n_mask_acc, N,
                                                  num_groups, GROUP_SIZE, False, MAGIC)
            a_next, scale, offset = _next_tile_operands(
                w_smem, bars, s_ptr, qz_ptr, t_begin, i + 1, n_tiles, offs_n, n_mask, N, num_groups, scale, offset,
                a_layout, dtype, GROUP_SIZE, ZERO_LOADS, MAGIC, STAGES, 0, zr)
            part = warpgroup_mma_wait(
                num_outstanding=0, deps=(part, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]))[0]
            acc += part * scale_acc[:, None]
            if not SCALE_RING:
                scale_acc = scale_acc_next
            _refill_stage(x_desc, w_desc, w_smem, x_smem, bars, stage, i, n_tiles, t_begin, off_m, off_n, STAGES, sc)
            a = a_next
        part = _tile_mmas(a, x_smem, (n_tiles - 1) % STAGES, part)
        if SCALE_RING:
            scale_acc = s_smem.index((n_tiles - 1) % STAGES).load(acc_rows).to(gl.float32)
        part = warpgroup_mma_wait(num_outstanding=0, deps=(part, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]))[0]
        acc += part * scale_acc[:, None]
    elif PER_TILE:
        # stage i % STAGES is refilled once tile i's wgmmas are done
        keep = gl.where(N != 0, -1, 0)  # all ones, which neither compiler can know (_after_wait)
        mbarrier.wait(bars.index(0), 0)
        a = _tile_operands(w_smem.index(0), offset, scale, a_layout, dtype)
        # the group parameters come one iteration ahead of their use (a global load's latency hidden)
        scale, offset = _group_params(s_ptr, qz_ptr, t_begin + gl.minimum(1, n_tiles - 1), offs_n, n_mask, N,
                                      num_groups, GROUP_SIZE, HAS_ZEROS, MAGIC)
        for i in range(n_tiles):
            stage = i % STAGES
            for j in gl.static_range(8):
                acc = warpgroup_mma(a[j], _x_slice(x_smem, stage, j), acc, is_async=True)
            # the next tile's operands while these multiply (the last tile converts itself again)
            a_next, scale, offset = _next_tile_operands(
                w_smem, bars, s_ptr, qz_ptr, t_begin, gl.minimum(i + 1, n_tiles - 1), n_tiles, offs_n, n_mask, N,
                num_groups, scale, offset, a_layout, dtype, GROUP_SIZE, HAS_ZEROS, MAGIC, STAGES, 1)
            acc = warpgroup_mma_wait(
                num_outstanding=0, deps=(acc, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]))[0]
            _refill_stage(x_desc, w_desc, w_smem, x_smem, bars, stage, i, n_tiles, t_begin, off_m, off_n, STAGES)
            if LIVE_OPERANDS:
                a = _after_wait(a_next, a, keep)
            else:
                a = a_next
    else:
        # tile i + STAGES - 1 refills tile i - 1's stage
        for i in range(n_tiles):
            # the next tile's group, loaded now and used next iteration (a global load's latency hidden)
            scale_next, offset_next = _group_params(
                s_ptr, qz_ptr, gl.minimum(t_begin + i + 1, num_tiles - 1), offs_n, n_mask, N, num_groups,
                GROUP_SIZE, HAS_ZEROS, MAGIC)
            stage = i % STAGES
            mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
            words = w_smem.index(stage).permute((1, 0)).load(a_layout)  # [BLOCK_N, 16] int32
            for j in gl.static_range(8):
                a = _operand(words, j, offset, scale, dtype)
                acc = warpgroup_mma(a, _x_slice(x_smem, stage, j), acc, is_async=True)
                acc, a = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a))
                if j == 0:
                    # every wgmma of tile i - 1 is done: refill its stage once all warps are here
                    _cta_barrier()
                    if i + STAGES - 1 < n_tiles:
                        _load_tile(x_desc, w_desc, w_smem, x_smem, bars, (i + STAGES - 1) % STAGES,
                                   t_begin + i + STAGES - 1, off_m, off_n)
            scale, offset = scale_next, offset_next
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))
    if PDL and LATE_DEPENDENTS:
        gdc_launch_dependents()
    _store_tile(acc, bias_ptr, out_ptr, final_ptr, counter_ptr, M, N, off_m, off_n, pid_k, stride_om, stride_split,
                HAS_BIAS, IS_SPLIT, SUM_SPLITS, mma_layout, SILU_MUL)


def launch_w4a16_wgmma(
    x: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor | None, bias: Tensor | None, group_size: int,
    block_m: int, block_n: int, split_k: int, num_warps: int, num_stages: int, per_tile: bool = False,
    scale_acc: bool = False, silu_mul: bool = False,
) -> Tensor:
    """x [M, K] (contiguous, 16-byte aligned rows) → [M, N] in x's dtype; with `silu_mul` (a gate_up in
    activation's interleaved row order, N a multiple of 16) SiLU(gate) · up [M, N / 2], made in the
    kernel's epilogue where the kernel finishes its tiles (unsplit, or split with semaphores)."""
    scale_ring = SCALE_RING and per_tile and scale_acc and _ring_fits(scales)
    zero_ring = scale_ring and ZERO_RING and qzeros is not None and _ring_fits(qzeros)
    return launch_tiled(_w4a16_wgmma_kernel, x, qweight, scales, qzeros, bias, group_size, block_m, block_n, split_k,
                        sum_in_kernel=True, silu_mul=silu_mul, STAGES=num_stages, PER_TILE=per_tile,
                        SCALE_ACC=scale_acc, num_warps=num_warps, SCALE_RING=scale_ring, ZERO_RING=zero_ring,
                        LIVE_OPERANDS=live_operands(per_tile, scale_acc, num_warps))


def live_operands(per_tile: bool, scale_acc: bool, num_warps: int) -> bool:
    """Whether a launch takes LIVE_OPERANDS: the per-tile order with scaled operands on one warpgroup."""
    return LIVE_OPERANDS and per_tile and not scale_acc and num_warps == 4


def _ring_fits(table: Tensor) -> bool:
    """Whether the TMA can bring a tile's part of a per-group table (the scales [G, N] or the zero words
    [G, ceil(N / 8)], read flat): contiguous, 16-byte aligned, rows of a multiple of 16 bytes (a box's
    first element 16-byte aligned: an H100 stops at an illegal instruction where it is not, e.g. the zero
    words of N = 1000), and not fp32 scales (those keep the global loads)."""
    return (table.is_contiguous() and table.dtype != torch.float32 and table.data_ptr() % 16 == 0
            and table.shape[-1] * table.element_size() % 16 == 0)


@functools.cache
def _shared_layout(block_shape: tuple[int, ...], dtype) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a TMA box of `block_shape` elements of `dtype`, built once per box (each
    build is ~10 µs of Python: a launch used to build two to four)."""
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), dtype)


def _weight_descriptor(table: Tensor, block_shape: tuple[int, ...], dtype) -> TensorDescriptor:
    """The TMA descriptor of a weight's packed words (2-D boxes) or of its scales / zero words (1-D boxes
    over the table read flat), built on the first launch with that box and kept on the table itself: a
    weight's pointer, shape and strides never change, and the descriptor goes when the table does."""
    cache = vars(table).setdefault("_llmc_tma_descriptors", {})
    descriptor = cache.get(block_shape)
    if descriptor is None:
        source = table if len(block_shape) == 2 else table.view(-1)
        descriptor = TensorDescriptor(source, list(source.shape), list(source.stride()), list(block_shape),
                                      _shared_layout(block_shape, dtype))
        cache[block_shape] = descriptor
    return descriptor


def launch_tiled(
    kernel, x: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor | None, bias: Tensor | None, group_size: int,
    block_m: int, block_n: int, split_k: int, sum_in_kernel: bool, silu_mul: bool = False,
    tma_store: bool | None = None, **constexprs,
) -> Tensor:
    """Launch a Gluon W4A16 kernel of this module's signature (and w4a16_ws's) over a grid of
    (weight-row tiles, K splits, token tiles): the TMA descriptors of x and of the packed words, the
    split plan, and the second kernel that sums the splits where the kernel does not
    (`sum_in_kernel`: it takes SUM_SPLITS and sums them itself where plan_splits gives semaphores).
    `silu_mul` (kernels that take SILU_MUL): SiLU(gate) · up of an interleaved gate_up, [M, N / 2].
    `tma_store` (kernels that take TMA_STORE): the output written by TMA stores where it can be (K not
    split, rows of a multiple of 16 bytes); the kernel then gets its descriptor (boxes of block_m tokens
    by X_BOX_K columns, the activations' layout) in place of the pointer."""
    M = x.shape[0]
    N = qweight.shape[1]
    num_tiles = qweight.shape[0] // 16
    tiles_n, tiles_m = triton.cdiv(N, block_n), triton.cdiv(M, block_m)
    tiles_per_split, split_k, out, target, counters = plan_splits(
        num_tiles, split_k, M, N, x, x.dtype, tiles_n * tiles_m if sum_in_kernel else 0, block_m,
        out_columns=N // 2 if silu_mul else N)
    is_split = split_k > 1
    if sum_in_kernel:
        constexprs["SUM_SPLITS"] = split_k if counters is not None else 0
    if silu_mul:
        constexprs["SILU_MUL"] = True
        constexprs["SILU_MUL_LATE_DEPENDENTS"] = SILU_MUL_LATE_DEPENDENTS
    x_layout = _shared_layout((block_m, X_BOX_K), _GL_DTYPE[x.dtype])
    x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [block_m, X_BOX_K], x_layout)
    w_desc = _weight_descriptor(qweight, (16, block_n), gl.int32)
    destination = target  # the kernel's output argument: the output, the split partials, or a TMA descriptor
    if tma_store is not None:
        constexprs["TMA_STORE"] = tma_store and not is_split and not silu_mul and N % 8 == 0
        if constexprs["TMA_STORE"]:
            destination = TensorDescriptor(out, [M, N], [N, 1], [block_m, X_BOX_K], x_layout)
    s_desc = z_desc = scales  # the scales' and zero words' TMA descriptors where the kernel takes SCALE_RING
    if constexprs.get("SCALE_RING"):
        s_desc = _weight_descriptor(scales, (block_n,), _GL_DTYPE[scales.dtype])
        if constexprs.get("ZERO_RING"):
            z_desc = _weight_descriptor(qzeros, (block_n // 8,), gl.int32)
    kernel[(tiles_n, split_k, tiles_m)](
        x_desc, w_desc, scales, qzeros if qzeros is not None else scales, bias if bias is not None else scales,
        destination, out, counters if counters is not None else out, s_desc, z_desc, M, N, scales.shape[0], num_tiles,
        tiles_per_split,
        N if is_split else out.stride(0), M * N,
        GROUP_SIZE=group_columns_of(group_size, num_tiles), HAS_ZEROS=qzeros is not None, HAS_BIAS=bias is not None,
        IS_SPLIT=is_split, **constexprs, **pdl_args(x.device),
    )
    if silu_mul and is_split and counters is None:  # the partials summed by the second kernel, then SiLU · mul
        gate_up = torch.empty(M, N, device=x.device, dtype=x.dtype)
        finish_splits(target, counters, bias, gate_up)
        return silu_and_mul(gate_up, GATE_UP_INTERLEAVE)
    finish_splits(target, counters, bias, out)
    return out
