"""W4A16 on Hopper, stream-K (kind "wgmma_streamk"; Gluon, sm_90 only, imported only when it runs).

The same product as w4a16_gluon's per-tile order (out.T = W · x.T, the weight converted in the
registers of the wgmma A operand, a whole 128-column K tile's operands converted while the previous
tile's eight wgmmas run), scheduled differently: one or two persistent programs per SM, and the flattened
list of (output tile, K tile) steps cut into equal contiguous ranges, one per program. A program
walks its range; where it finishes an output tile whose K it covered from the start, it stores it;
a tile cut between programs (at most two pieces of a program: its first and its last) is stored as
an fp32 partial into the program's slot, and the last of the tile's programs to arrive (an
acquire-release count per output tile) sums the partials in program order (deterministic) and
stores it. Split-K instead runs a fixed number of programs per output tile: with few output tiles
(a few hundred tokens on a 4096-wide weight) the SMs are either short of work or run an uneven last
wave, and each split pays its own pipeline start and end (benchmarks/RESULTS.md, session 14).
The ring of stages runs over the program's steps regardless of the tiles they belong to.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import device_num_sms
from .pdl_triton import pdl_args
from .split_k_triton import tile_counters
from .w4a16_gluon import (
    _GL_DTYPE, X_BOX_K, _cta_barrier, _group_params, _load_tile, _load_words, _load_x, _tile_operands,
    _wait_for_inputs, _x_slice,
)
from .w4a16_triton import group_columns_of


@gluon.jit
def _step(g, kt, tiles_n, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr):
    """Step g of the flattened list → (output tile, K tile, first weight row, first token)."""
    tile = g // kt
    return tile, g % kt, (tile % tiles_n) * BLOCK_N, (tile // tiles_n) * BLOCK_M


@gluon.jit
def _next(tile, k, kt):
    """The step after (tile, K tile k): K tile k + 1 of the same output tile, or the next tile's first."""
    wrap = (k + 1 == kt).to(gl.int32)
    return tile + wrap, k + 1 - kt * wrap


@gluon.jit
def _store_out(acc, bias_ptr, out_ptr, offs_on, offs_om, M, N, HAS_BIAS: gl.constexpr):
    if HAS_BIAS:
        acc += gl.load(bias_ptr + offs_on, mask=offs_on < N, other=0.0).to(gl.float32)[:, None]
    mask = (offs_on < N)[:, None] & (offs_om < M)[None, :]
    gl.store(out_ptr + offs_om[None, :] * N + offs_on[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _finish_piece(acc, bias_ptr, out_ptr, ws_ptr, counter_ptr, M, N, tile, k, kt, tiles_n, start, per,
                  HAS_BIAS: gl.constexpr, mma_layout: gl.constexpr, num_warps: gl.constexpr):
    """The program's piece of output tile `tile`, ending at K tile k: stored, or kept as a partial and
    summed by the tile's last program (32 rows at a time: the accumulator stays as it is, so the
    loop carries it without copies)."""
    BLOCK_N: gl.constexpr = acc.shape[0]
    BLOCK_M: gl.constexpr = acc.shape[1]
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma_layout))
    cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma_layout))
    off_n = (tile % tiles_n) * BLOCK_N
    off_m = (tile // tiles_n) * BLOCK_M
    tile_begin = tile * kt
    if (start <= tile_begin) & (k == kt - 1):  # the whole of the tile's K
        _store_out(acc, bias_ptr, out_ptr, off_n + rows, off_m + cols, M, N, HAS_BIAS)
    else:
        # slot 0: the piece that begins the program's range; slot 1: its last piece, begun at a tile start
        slot = (start < tile_begin).to(gl.int32)
        gl.store(ws_ptr + (gl.program_id(0) * 2 + slot) * (BLOCK_N * BLOCK_M) + rows[:, None] * BLOCK_M
                 + cols[None, :], acc)
        _cta_barrier()  # every thread's partial is stored before the count is released
        first = tile_begin // per
        last = (tile_begin + kt - 1) // per
        arrived = gl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == last - first:
            # in program order; the first program's piece is its range's first (slot 0) only if its
            # range begins inside this tile, every later program's piece begins its range
            first_slot = (first * per < tile_begin).to(gl.int32)
            CHUNK: gl.constexpr = 32
            layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])
            c_rows = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
            c_cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, layout))
            for r in gl.static_range(0, BLOCK_N, CHUNK):
                local = (r + c_rows)[:, None] * BLOCK_M + c_cols[None, :]
                total = gl.load(ws_ptr + (first * 2 + first_slot) * (BLOCK_N * BLOCK_M) + local, cache_modifier=".cg")
                for program in range(first + 1, last + 1):
                    total += gl.load(ws_ptr + program * 2 * (BLOCK_N * BLOCK_M) + local, cache_modifier=".cg")
                _store_out(total, bias_ptr, out_ptr, off_n + r + c_rows, off_m + c_cols, M, N, HAS_BIAS)
            gl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")


@gluon.jit
def _w4a16_streamk_kernel(
    x_desc, w_desc, s_ptr, qz_ptr, bias_ptr, out_ptr, ws_ptr, counter_ptr,
    M, N, num_groups, kt, tiles_n, total, per,
    GROUP_SIZE: gl.constexpr, HAS_ZEROS: gl.constexpr, HAS_BIAS: gl.constexpr,
    STAGES: gl.constexpr, PDL: gl.constexpr, num_warps: gl.constexpr,
):
    """Steps [program * per, min(total, (program + 1) * per)) of the flattened (tile, K tile) list."""
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[1]
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    dtype: gl.constexpr = x_desc.dtype
    MAGIC: gl.constexpr = 128.0 if dtype == gl.bfloat16 else 1024.0
    start = gl.program_id(0) * per
    n_steps = gl.minimum(per, total - start)

    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, a_layout))

    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, 16, BLOCK_N], w_desc.layout)
    x_smem = gl.allocate_shared_memory(dtype, [2 * STAGES, BLOCK_M, 64], x_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    tile0 = start // kt
    k0 = start % kt
    off_n0 = (tile0 % tiles_n) * BLOCK_N
    for s in gl.static_range(STAGES):  # the weights before the wait for the activations' writer (PDL)
        if s < n_steps:
            _, k, off_n, _ = _step(start + s, kt, tiles_n, BLOCK_N, BLOCK_M)
            _load_words(x_desc, w_desc, w_smem, bars, s, k, off_n)
    _wait_for_inputs(PDL)
    for s in gl.static_range(STAGES):
        if s < n_steps:
            _, k, _, off_m = _step(start + s, kt, tiles_n, BLOCK_N, BLOCK_M)
            _load_x(x_desc, x_smem, bars, s, k, off_m)

    scale, offset = _group_params(s_ptr, qz_ptr, k0, off_n0 + rows, off_n0 + rows < N, N, num_groups, GROUP_SIZE,
                                  HAS_ZEROS, MAGIC)
    mbarrier.wait(bars.index(0), 0)
    a = _tile_operands(w_smem, 0, offset, scale, a_layout, dtype)
    # step coordinates advance by one each iteration (no division in the loop): this step's (tile, k),
    # the step whose group parameters load now (one step ahead of their use, a global load's latency
    # hidden; past the range they are loaded, masked, and not used), the step whose tile loads now
    tile, k = tile0, k0
    p_tile, p_k = _next(tile0, k0, kt)
    l_tile = (start + STAGES - 1) // kt
    l_k = (start + STAGES - 1) % kt
    scale, offset = _group_params(s_ptr, qz_ptr, p_k, (p_tile % tiles_n) * BLOCK_N + rows,
                                  (p_tile % tiles_n) * BLOCK_N + rows < N, N, num_groups, GROUP_SIZE, HAS_ZEROS, MAGIC)
    acc = gl.zeros((BLOCK_N, BLOCK_M), gl.float32, mma_layout)
    for j in range(n_steps):
        stage = j % STAGES
        acc = warpgroup_mma(a[0], _x_slice(x_smem, stage, 0), acc, use_acc=k > 0, is_async=True)  # a new tile: 0
        for jj in gl.static_range(1, 8):
            acc = warpgroup_mma(a[jj], _x_slice(x_smem, stage, jj), acc, is_async=True)
        # the next step's operands while these multiply (the last step converts itself again)
        j_next = gl.minimum(j + 1, n_steps - 1)
        p_tile, p_k = _next(p_tile, p_k, kt)
        p_off_n = (p_tile % tiles_n) * BLOCK_N
        scale_after, offset_after = _group_params(s_ptr, qz_ptr, p_k, p_off_n + rows, p_off_n + rows < N, N,
                                                  num_groups, GROUP_SIZE, HAS_ZEROS, MAGIC)
        mbarrier.wait(bars.index(j_next % STAGES), (j_next // STAGES) & 1)
        a_next = _tile_operands(w_smem, j_next % STAGES, offset, scale, a_layout, dtype)
        scale, offset = scale_after, offset_after
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]))[0]
        if (k == kt - 1) | (j == n_steps - 1):
            _finish_piece(acc, bias_ptr, out_ptr, ws_ptr, counter_ptr, M, N, tile, k, kt, tiles_n, start, per,
                          HAS_BIAS, mma_layout, num_warps)
        _cta_barrier()  # no warp still reads this stage
        l_tile, l_k = _next(l_tile, l_k, kt)
        if j + STAGES < n_steps:
            _load_tile(x_desc, w_desc, w_smem, x_smem, bars, stage, l_k, (l_tile // tiles_n) * BLOCK_M,
                       (l_tile % tiles_n) * BLOCK_N)
        tile, k = _next(tile, k, kt)
        a = a_next
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(s))


def streamk_plan(m: int, n: int, k_tiles: int, block_m: int, block_n: int, num_programs: int) -> tuple[int, int, int]:
    """(programs, steps per program, steps) for one product: `num_programs` (fewer when there are fewer
    steps), equal contiguous ranges, none empty."""
    total = triton.cdiv(n, block_n) * triton.cdiv(m, block_m) * k_tiles
    per = triton.cdiv(total, min(num_programs, total))
    return triton.cdiv(total, per), per, total


def launch_w4a16_streamk(
    x: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor | None, bias: Tensor | None, group_size: int,
    block_m: int, block_n: int, num_warps: int, num_stages: int, programs_per_sm: int = 1,
) -> Tensor | None:
    """x [M, K] (contiguous, 16-byte aligned rows) → [M, N] in x's dtype; None where the tiles'
    semaphores cannot be had (the first split GEMM of a device inside a CUDA-graph capture)."""
    M, K = x.shape
    N = qweight.shape[1]
    k_tiles = qweight.shape[0] // 16
    tiles_n = triton.cdiv(N, block_n)
    counters = tile_counters(x.device, tiles_n * triton.cdiv(M, block_m))
    if counters is None:
        return None
    programs, per, total = streamk_plan(M, N, k_tiles, block_m, block_n,
                                        programs_per_sm * device_num_sms(x.device))
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    partials = torch.empty(programs * 2 * block_n * block_m, device=x.device, dtype=torch.float32)
    x_layout = gl.NVMMASharedLayout.get_default_for([block_m, X_BOX_K], _GL_DTYPE[x.dtype])
    w_layout = gl.NVMMASharedLayout.get_default_for([16, block_n], gl.int32)
    x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [block_m, X_BOX_K], x_layout)
    w_desc = TensorDescriptor(qweight, list(qweight.shape), list(qweight.stride()), [16, block_n], w_layout)
    _w4a16_streamk_kernel[(programs,)](
        x_desc, w_desc, scales, qzeros if qzeros is not None else scales, bias if bias is not None else scales,
        out, partials, counters, M, N, scales.shape[0], k_tiles, tiles_n, total, per,
        GROUP_SIZE=group_columns_of(group_size, k_tiles), HAS_ZEROS=qzeros is not None, HAS_BIAS=bias is not None,
        STAGES=num_stages, num_warps=num_warps, **pdl_args(x.device),
    )
    return out
