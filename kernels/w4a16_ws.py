"""W4A16 on Hopper, warp-specialized (kind "wgmma_ws"; Gluon, sm_90 only, imported only when it runs).

The per-tile order of w4a16_gluon (the weight converted in the registers of the wgmma A operand, a
tile's eight operands converted while the previous tile's wgmmas run), with the work split by warp:
one producer warp issues the TMA loads into the ring of stages, and each of two consumer warpgroups
(a partition of its own) converts and multiplies its 64 of the tile's 128 weight rows. A consumer
hands a stage back with an mbarrier arrival once its wgmmas reading it are retired, and the producer
refills the stage when both have; so no barrier spans the CTA inside the loop (the split kernel's
CTA barrier before each refill was its top stall at 256 and 4096 tokens, benchmarks/RESULTS.md
session 14), and each warpgroup runs ahead of the other as far as the ring allows.

The second warpgroup starts once the first has queued its first tile's wgmmas, and stays behind:
each waits for its own wgmmas while the other's run, so the tensor cores' queue does not empty at
every tile as it does when both issue and wait together (H100, session 15: 79 of 95 configs faster,
by up to 11%, benchmarks/RESULTS.md). Within a warpgroup ptxas converts the next tile after the wait
for this tile's wgmmas (it reuses their operand registers); w4a16_gluon.LIVE_OPERANDS, which moves part
of that conversion in front of the wait, made this kernel 2-10% slower (session 24) and is not used here.
"""

from __future__ import annotations

from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                warpgroup_mma_wait)

from .w4a16_gemm import WS_BLOCK_N
from .w4a16_gluon import (_add_bias, _cta_barrier, _group_params, _load_prologue, _load_tile, _store_tile, _tile_operands,
                          _tma_store, _x_slice, launch_tiled)

ROWS_PER_WARPGROUP = gl.constexpr(WS_BLOCK_N // 2)
TMA_STORE = True  # the finished tile out by TMA stores (_store_tile_tma) where launch_tiled can describe it


@gluon.jit
def _producer(x_desc, w_desc, w_smem, x_smem, ready, empty, t_begin, n_tiles, off_m, off_n,
              STAGES: gl.constexpr, PDL: gl.constexpr):
    """One warp: the first stages' weights before the wait for the activations' writer (PDL), then
    every tile into its stage once both consumers have handed the stage back."""
    _load_prologue(x_desc, w_desc, w_smem, x_smem, ready, t_begin, n_tiles, off_m, off_n, STAGES, PDL)
    for i in range(STAGES, n_tiles):
        stage = i % STAGES
        mbarrier.wait(empty.index(stage), ((i // STAGES) - 1) & 1)
        _load_tile(x_desc, w_desc, w_smem, x_smem, ready, stage, t_begin + i, off_m, off_n)


@gluon.jit
def _consumer(x_desc, w_smem, x_smem, ready, empty, s_ptr, qz_ptr, bias_ptr, out_ptr, final_ptr, counter_ptr,
              M, N, num_groups, t_begin, n_tiles, num_tiles, off_m, off_n, pid_k, stride_om, stride_split,
              row0: gl.constexpr, GROUP_SIZE: gl.constexpr, HAS_ZEROS: gl.constexpr, HAS_BIAS: gl.constexpr,
              IS_SPLIT: gl.constexpr, STAGES: gl.constexpr, TMA_STORE: gl.constexpr, turn):
    """One warpgroup: weight rows off_n + row0 ... + 63 of the tile, in the per-tile order."""
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    dtype: gl.constexpr = x_desc.dtype
    MAGIC: gl.constexpr = 128.0 if dtype == gl.bfloat16 else 1024.0
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    offs_n = off_n + row0 + gl.arange(0, ROWS_PER_WARPGROUP, layout=gl.SliceLayout(1, a_layout))
    n_mask = offs_n < N
    scale, offset = _group_params(s_ptr, qz_ptr, t_begin, offs_n, n_mask, N, num_groups, GROUP_SIZE, HAS_ZEROS, MAGIC)
    mbarrier.wait(ready.index(0), 0)
    a = _tile_operands(w_smem.index(0).slice(row0, ROWS_PER_WARPGROUP, dim=1), offset, scale, a_layout, dtype)
    # the group parameters come one tile ahead of their use (a global load's latency hidden)
    scale, offset = _group_params(s_ptr, qz_ptr, t_begin + gl.minimum(1, n_tiles - 1), offs_n, n_mask, N,
                                  num_groups, GROUP_SIZE, HAS_ZEROS, MAGIC)
    acc = gl.zeros((ROWS_PER_WARPGROUP, BLOCK_M), gl.float32, mma_layout)
    if row0 != 0:  # staggered: the first warpgroup's first wgmmas go into the tensor cores' queue first
        mbarrier.wait(turn, 0)
    for i in range(n_tiles):
        stage = i % STAGES
        for j in gl.static_range(8):
            acc = warpgroup_mma(a[j], _x_slice(x_smem, stage, j), acc, is_async=True)
        if row0 == 0:
            if i == 0:
                mbarrier.arrive(turn)
        # the next tile's operands while these multiply (the last tile converts itself again)
        i_next = gl.minimum(i + 1, n_tiles - 1)
        scale_after, offset_after = _group_params(s_ptr, qz_ptr, t_begin + gl.minimum(i + 2, n_tiles - 1), offs_n,
                                                  n_mask, N, num_groups, GROUP_SIZE, HAS_ZEROS, MAGIC)
        mbarrier.wait(ready.index(i_next % STAGES), (i_next // STAGES) & 1)
        a_next = _tile_operands(w_smem.index(i_next % STAGES).slice(row0, ROWS_PER_WARPGROUP, dim=1), offset,
                                scale, a_layout, dtype)
        scale, offset = scale_after, offset_after
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]))[0]
        mbarrier.arrive(empty.index(stage))  # this warpgroup no longer reads the stage
        a = a_next
    if TMA_STORE:
        _store_tile_tma(acc, x_smem, empty, out_ptr, bias_ptr, N, n_tiles, off_m, off_n, row0, HAS_BIAS, STAGES,
                        mma_layout)
    else:
        _store_tile(acc, bias_ptr, out_ptr, final_ptr, counter_ptr, M, N, off_m, off_n + row0, pid_k, stride_om,
                    stride_split, HAS_BIAS, IS_SPLIT, 0, mma_layout)


@gluon.jit
def _store_tile_tma(acc, x_smem, empty, out_desc, bias_ptr, N, n_tiles, off_m, off_n, row0: gl.constexpr,
                    HAS_BIAS: gl.constexpr, STAGES: gl.constexpr, mma_layout: gl.constexpr):
    """This warpgroup's [64 rows, BLOCK_M tokens] of the tile (bias added) into out [M, N] by one TMA store
    (it clips the M and N tails): through this warpgroup's activation box of the next-to-last tile's stage,
    once both warpgroups have left that stage (its empty barrier; the producer loads nothing more; the
    last tile's stage would make the first warpgroup wait for the other's last wgmmas), transposed to
    out's [tokens, rows] on the way into shared memory. The pointer epilogue (_store_tile) writes
    2-byte elements a token's row apart, 32 per warp instruction."""
    acc, _ = _add_bias(acc, bias_ptr, N, off_n + row0, HAS_BIAS, mma_layout)
    spent = gl.maximum(n_tiles - 2, 0)  # the next-to-last tile's stage: the other warpgroup has most likely left it
    mbarrier.wait(empty.index(spent % STAGES), (spent // STAGES) & 1)
    box = x_smem.index(2 * (spent % STAGES) + row0 // ROWS_PER_WARPGROUP)
    box.store(gl.permute(acc.to(out_desc.dtype), (1, 0)))
    fence_async_shared()
    _cta_barrier()  # (this warpgroup's) every thread's part is in shared memory before the store is issued
    _tma_store(out_desc, [off_m, off_n + row0], box)
    tma.store_wait(0)


@gluon.jit
def _w4a16_ws_kernel(
    x_desc, w_desc, s_ptr, qz_ptr, bias_ptr, out_ptr, final_ptr, counter_ptr, s_desc, z_desc,
    M, N, num_groups, num_tiles, tiles_per_split, stride_om, stride_split,
    GROUP_SIZE: gl.constexpr, HAS_ZEROS: gl.constexpr, HAS_BIAS: gl.constexpr, IS_SPLIT: gl.constexpr,
    STAGES: gl.constexpr, PDL: gl.constexpr, CONSUMER_REGS: gl.constexpr, TMA_STORE: gl.constexpr,
    num_warps: gl.constexpr,
):
    """out [M, N] (or this K split's fp32 partial) for one [128 weight rows, BLOCK_M tokens] tile;
    launched with num_warps 4 (the first consumer), the second consumer and the producer added."""
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[1]
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    dtype: gl.constexpr = x_desc.dtype
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    pid_m = gl.program_id(2)
    off_n = pid_n * BLOCK_N
    off_m = pid_m * BLOCK_M
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, 16, BLOCK_N], w_desc.layout)
    x_smem = gl.allocate_shared_memory(dtype, [2 * STAGES, BLOCK_M, 64], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(turn, count=1)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # one arrival per consumer warpgroup
    t_begin = pid_k * tiles_per_split
    n_tiles = gl.minimum(tiles_per_split, num_tiles - t_begin)
    # each partition's arguments written out: a tuple built by concatenation turns constexprs into ints
    gl.warp_specialize([
        (_consumer, (x_desc, w_smem, x_smem, ready, empty, s_ptr, qz_ptr, bias_ptr, out_ptr, final_ptr, counter_ptr,
                     M, N, num_groups, t_begin, n_tiles, num_tiles, off_m, off_n, pid_k, stride_om, stride_split,
                     gl.constexpr(0), GROUP_SIZE, HAS_ZEROS, HAS_BIAS, IS_SPLIT, STAGES, TMA_STORE, turn)),
        (_consumer, (x_desc, w_smem, x_smem, ready, empty, s_ptr, qz_ptr, bias_ptr, out_ptr, final_ptr, counter_ptr,
                     M, N, num_groups, t_begin, n_tiles, num_tiles, off_m, off_n, pid_k, stride_om, stride_split,
                     gl.constexpr(64), GROUP_SIZE, HAS_ZEROS, HAS_BIAS, IS_SPLIT, STAGES, TMA_STORE, turn)),  # ROWS_PER_WARPGROUP
        (_producer, (x_desc, w_desc, w_smem, x_smem, ready, empty, t_begin, n_tiles, off_m, off_n, STAGES, PDL)),
    ], [4, 1], [CONSUMER_REGS, 40])


def launch_w4a16_ws(
    x: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor | None, bias: Tensor | None, group_size: int,
    block_m: int, split_k: int, num_stages: int,
) -> Tensor:
    """x [M, K] (contiguous, 16-byte aligned rows) → [M, N] in x's dtype; 128 weight rows per tile."""
    return launch_tiled(_w4a16_ws_kernel, x, qweight, scales, qzeros, bias, group_size, block_m, WS_BLOCK_N, split_k,
                        sum_in_kernel=False, tma_store=TMA_STORE, STAGES=num_stages, CONSUMER_REGS=232, num_warps=4)
