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

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from . import device_index, device_num_sms
from .pdl_triton import pdl_args
from .split_k_triton import tile_counters
from .w4a16_gemm import WS_BLOCK_N, stream_k_plan
from .w4a16_triton import group_columns_of
from .w4a16_gluon import (_cta_barrier, _finish_tile, _group_params, _load_prologue, _load_tile, _store_tile,
                          _tile_operands, _wait_for_inputs, _x_slice, launch_tiled, tma_descriptors)

# -1: the warpgroups staggered once; n >= 0: they take turns at every tile, each issuing its wgmmas once the
# other's are done but n (the other then converts its next tile while these run)
PINGPONG = -1


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
def _consume_tiles(w_smem, x_smem, ready, empty, turn, s_ptr, qz_ptr, N, num_groups, t_begin, n_tiles, g, off_n,
                   row0: gl.constexpr, BLOCK_M: gl.constexpr, dtype: gl.constexpr, GROUP_SIZE: gl.constexpr,
                   HAS_ZEROS: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr):
    """One warpgroup's sum over K tiles t_begin ... t_begin + n_tiles - 1 (n_tiles >= 1) of weight rows
    off_n + row0 ... + 63, in the per-tile order, from ring positions g ... g + n_tiles - 1 (the tiles this
    warpgroup took from the ring before): the [64, BLOCK_M] fp32 accumulator."""
    MAGIC: gl.constexpr = 128.0 if dtype == gl.bfloat16 else 1024.0
    ROWS: gl.constexpr = w_smem.shape[2] // 2  # this warpgroup's half of the tile's weight rows
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    offs_n = off_n + row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, a_layout))
    n_mask = offs_n < N
    scale, offset = _group_params(s_ptr, qz_ptr, t_begin, offs_n, n_mask, N, num_groups, GROUP_SIZE, HAS_ZEROS, MAGIC)
    mbarrier.wait(ready.index(g % STAGES), (g // STAGES) & 1)
    a = _tile_operands(w_smem.index(g % STAGES).slice(row0, ROWS, dim=1), offset, scale, a_layout, dtype)
    # the group parameters come one tile ahead of their use (a global load's latency hidden)
    scale, offset = _group_params(s_ptr, qz_ptr, t_begin + gl.minimum(1, n_tiles - 1), offs_n, n_mask, N,
                                  num_groups, GROUP_SIZE, HAS_ZEROS, MAGIC)
    acc = gl.zeros((ROWS, BLOCK_M), gl.float32, mma_layout)
    if PINGPONG < 0 and row0 != 0:  # staggered: the first warpgroup's first wgmmas go into the queue first
        if g == 0:
            mbarrier.wait(turn.index(0), 0)
    for i in range(n_tiles):
        stage = (g + i) % STAGES
        if PINGPONG >= 0:  # this warpgroup's turn: the other one's wgmmas (all but PINGPONG) are done
            if row0 == 0:
                if g + i > 0:
                    mbarrier.wait(turn.index(0), (g + i - 1) & 1)
            else:
                mbarrier.wait(turn.index(1), (g + i) & 1)
        for j in gl.static_range(8):
            acc = warpgroup_mma(a[j], _x_slice(x_smem, stage, j), acc, is_async=True)
        if PINGPONG < 0 and row0 == 0:
            if g + i == 0:
                mbarrier.arrive(turn.index(0))
        # the next tile's operands while these multiply (the last tile converts itself again)
        i_next = gl.minimum(i + 1, n_tiles - 1)
        scale_after, offset_after = _group_params(s_ptr, qz_ptr, t_begin + gl.minimum(i + 2, n_tiles - 1), offs_n,
                                                  n_mask, N, num_groups, GROUP_SIZE, HAS_ZEROS, MAGIC)
        mbarrier.wait(ready.index((g + i_next) % STAGES), ((g + i_next) // STAGES) & 1)
        a_next = _tile_operands(w_smem.index((g + i_next) % STAGES).slice(row0, ROWS, dim=1), offset,
                                scale, a_layout, dtype)
        scale, offset = scale_after, offset_after
        if PINGPONG > 0:
            acc = warpgroup_mma_wait(num_outstanding=PINGPONG, deps=(acc, a[7]))[0]
        if PINGPONG >= 0:
            mbarrier.arrive(turn.index(1 - row0 // ROWS))
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]))[0]
        mbarrier.arrive(empty.index(stage))  # this warpgroup no longer reads the stage
        a = a_next
    return acc


@gluon.jit
def _consumer(x_desc, w_smem, x_smem, ready, empty, s_ptr, qz_ptr, bias_ptr, out_ptr, final_ptr, counter_ptr,
              M, N, num_groups, t_begin, n_tiles, num_tiles, off_m, off_n, pid_k, stride_om, stride_split,
              row0: gl.constexpr, GROUP_SIZE: gl.constexpr, HAS_ZEROS: gl.constexpr, HAS_BIAS: gl.constexpr,
              IS_SPLIT: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr, turn):
    """One warpgroup: weight rows off_n + row0 ... + 63 of the tile, in the per-tile order."""
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    acc = _consume_tiles(w_smem, x_smem, ready, empty, turn, s_ptr, qz_ptr, N, num_groups, t_begin, n_tiles, 0, off_n,
                         row0, BLOCK_M, x_desc.dtype, GROUP_SIZE, HAS_ZEROS, STAGES, PINGPONG)
    _store_tile(acc, bias_ptr, out_ptr, final_ptr, counter_ptr, M, N, off_m, off_n + row0, pid_k, stride_om,
                stride_split, HAS_BIAS, IS_SPLIT, 0, mma_layout)


@gluon.jit
def _w4a16_ws_kernel(
    x_desc, w_desc, s_ptr, qz_ptr, bias_ptr, out_ptr, final_ptr, counter_ptr, s_desc, z_desc,
    M, N, num_groups, num_tiles, tiles_per_split, stride_om, stride_split,
    GROUP_SIZE: gl.constexpr, HAS_ZEROS: gl.constexpr, HAS_BIAS: gl.constexpr, IS_SPLIT: gl.constexpr,
    STAGES: gl.constexpr, PDL: gl.constexpr, CONSUMER_REGS: gl.constexpr, PINGPONG: gl.constexpr,
    num_warps: gl.constexpr,
):
    """out [M, N] (or this K split's fp32 partial) for one [128 weight rows, BLOCK_M tokens] tile;
    launched with num_warps 4 (the first consumer), the second consumer and the producer added."""
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[1]
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    ROWS: gl.constexpr = BLOCK_N // 2  # the second consumer's first row
    dtype: gl.constexpr = x_desc.dtype
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    pid_m = gl.program_id(2)
    off_n = pid_n * BLOCK_N
    off_m = pid_m * BLOCK_M
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, 16, BLOCK_N], w_desc.layout)
    x_smem = gl.allocate_shared_memory(dtype, [2 * STAGES, BLOCK_M, 64], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
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
                     gl.constexpr(0), GROUP_SIZE, HAS_ZEROS, HAS_BIAS, IS_SPLIT, STAGES, PINGPONG, turn)),
        (_consumer, (x_desc, w_smem, x_smem, ready, empty, s_ptr, qz_ptr, bias_ptr, out_ptr, final_ptr, counter_ptr,
                     M, N, num_groups, t_begin, n_tiles, num_tiles, off_m, off_n, pid_k, stride_om, stride_split,
                     ROWS, GROUP_SIZE, HAS_ZEROS, HAS_BIAS, IS_SPLIT, STAGES, PINGPONG, turn)),
        (_producer, (x_desc, w_desc, w_smem, x_smem, ready, empty, t_begin, n_tiles, off_m, off_n, STAGES, PDL)),
    ], [4, 1], [CONSUMER_REGS, 40])


def launch_w4a16_ws(
    x: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor | None, bias: Tensor | None, group_size: int,
    block_m: int, split_k: int, num_stages: int, block_n: int = WS_BLOCK_N,
) -> Tensor:
    """x [M, K] (contiguous, 16-byte aligned rows) → [M, N] in x's dtype; block_n (128 or 256) weight rows
    per tile."""
    return launch_tiled(_w4a16_ws_kernel, x, qweight, scales, qzeros, bias, group_size, block_m, block_n, split_k,
                        sum_in_kernel=False, STAGES=num_stages, CONSUMER_REGS=232, PINGPONG=PINGPONG,
                        num_warps=4)


# The persistent kernel (kind "wgmma_sk"): one CTA per SM, each through a list of (output tile, K tiles) units:
# first its share of the stream-K tiles (K tile i of stream-K tile u is unit u * num_k + i of 0 ... sk_tiles *
# num_k - 1, cut into one contiguous range per CTA), then whole tiles, one per CTA per wave (sk_tiles + pid,
# + num_programs, ...). A tile cut between CTAs is finished by the CTA holding its first K tile (its "owner",
# which reaches it at the end of its range); the others (at the start of theirs) leave their fp32 sums in the
# workspace slot of their CTA and count themselves on the tile's semaphore.


@gluon.jit
def _sk_owner(unit, sk_units):
    """The CTA whose stream-K range holds unit (ranges begin at pid * sk_units // num_programs)."""
    P = gl.num_programs(0)
    return ((unit + 1) * P + sk_units - 1) // sk_units - 1


@gluon.jit
def _sk_segment(it, sk_end, num_k):
    """The stream-K units from `it` up to the end of its tile or of the range: (tile, first K tile, count)."""
    tile = it // num_k
    k0 = it - tile * num_k
    return tile, k0, gl.minimum(sk_end - it, num_k - k0)


@gluon.jit
def _sk_range(sk_tiles, num_k):
    sk_units = sk_tiles * num_k
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    return pid * sk_units // P, (pid + 1) * sk_units // P


@gluon.jit
def _sk_producer(x_desc, w_desc, w_smem, x_smem, ready, empty, num_k, tiles_n, sk_tiles, dp_waves,
                 STAGES: gl.constexpr, PDL: gl.constexpr):
    """One warp: every unit of the CTA, in order, into the ring."""
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[1]
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    _wait_for_inputs(PDL)
    it, sk_end = _sk_range(sk_tiles, num_k)
    g = 0
    while it < sk_end:
        tile, k0, count = _sk_segment(it, sk_end, num_k)
        for i in range(count):
            _sk_load(x_desc, w_desc, w_smem, x_smem, ready, empty, g + i, k0 + i, (tile // tiles_n) * BLOCK_M,
                     (tile % tiles_n) * BLOCK_N, STAGES)
        g += count
        it += count
    for wave in range(dp_waves):
        tile = sk_tiles + gl.program_id(0) + wave * gl.num_programs(0)
        for i in range(num_k):
            _sk_load(x_desc, w_desc, w_smem, x_smem, ready, empty, g + i, i, (tile // tiles_n) * BLOCK_M,
                     (tile % tiles_n) * BLOCK_N, STAGES)
        g += num_k


@gluon.jit
def _sk_load(x_desc, w_desc, w_smem, x_smem, ready, empty, g, t, off_m, off_n, STAGES: gl.constexpr):
    """K tile t of the output tile at (off_m, off_n) into ring position g, once both consumers left it."""
    stage = g % STAGES
    if g >= STAGES:
        mbarrier.wait(empty.index(stage), ((g // STAGES) - 1) & 1)
    _load_tile(x_desc, w_desc, w_smem, x_smem, ready, stage, t, off_m, off_n)


@gluon.jit
def _slot(part_ptr, cta, row0: gl.constexpr, ROWS: gl.constexpr, mma_layout: gl.constexpr, BLOCK_M: gl.constexpr):
    """The pointers of a warpgroup's [ROWS, BLOCK_M] part of a CTA's workspace slot (fp32 [2 ROWS, BLOCK_M]),
    made where they are used (held across the loop they would take 128 registers a thread)."""
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma_layout))
    cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma_layout))
    return part_ptr + cta * (2 * ROWS * BLOCK_M) + (row0 + rows[:, None]) * BLOCK_M + cols[None, :]


@gluon.jit
def _sk_consumer(x_desc, w_smem, x_smem, ready, empty, turn, s_ptr, qz_ptr, bias_ptr, out_ptr, part_ptr, flag_ptr,
                 M, N, num_groups, num_k, tiles_n, sk_tiles, dp_waves, stride_om,
                 row0: gl.constexpr, GROUP_SIZE: gl.constexpr, HAS_ZEROS: gl.constexpr, HAS_BIAS: gl.constexpr,
                 STAGES: gl.constexpr, PINGPONG: gl.constexpr):
    """One warpgroup: its 64 rows of every unit of the CTA."""
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    dtype: gl.constexpr = x_desc.dtype
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    pid = gl.program_id(0)
    ROWS: gl.constexpr = w_smem.shape[2] // 2
    half = row0 // ROWS  # this warpgroup's semaphore of a tile (two per tile)
    it, sk_end = _sk_range(sk_tiles, num_k)
    sk_units = sk_tiles * num_k
    g = 0
    while it < sk_end:
        tile, k0, count = _sk_segment(it, sk_end, num_k)
        off_m = (tile // tiles_n) * BLOCK_M
        off_n = (tile % tiles_n) * (2 * ROWS)
        acc = _consume_tiles(w_smem, x_smem, ready, empty, turn, s_ptr, qz_ptr, N, num_groups, k0, count, g, off_n,
                             row0, BLOCK_M, dtype, GROUP_SIZE, HAS_ZEROS, STAGES, PINGPONG)
        flag = flag_ptr + 2 * tile + half
        if k0 > 0:  # a later part of the tile's K: the sum to the workspace, then counted
            gl.store(_slot(part_ptr, pid, row0, ROWS, mma_layout, BLOCK_M), acc)
            _cta_barrier()  # (this warpgroup's named barrier) every thread's sum is stored before the count
            gl.atomic_add(flag, 1, sem="release", scope="gpu")
        else:
            peers = _sk_owner(it - k0 + num_k - 1, sk_units) - pid  # 0 where the whole tile is this CTA's
            if peers > 0:
                arrived = gl.atomic_add(flag, 0, sem="acquire", scope="gpu")
                while arrived < peers:
                    arrived = gl.atomic_add(flag, 0, sem="acquire", scope="gpu")
                for peer in range(1, peers + 1):  # in CTA order: the same sum whatever the timing
                    acc += gl.load(_slot(part_ptr, pid + peer, row0, ROWS, mma_layout, BLOCK_M), cache_modifier=".cg")
                gl.atomic_xchg(flag, 0, sem="relaxed", scope="gpu")  # zero again for the next kernel
            _finish_tile(acc, bias_ptr, out_ptr, M, N, off_m, off_n + row0, stride_om, HAS_BIAS, False, mma_layout)
        g += count
        it += count
    for wave in range(dp_waves):
        tile = sk_tiles + pid + wave * gl.num_programs(0)
        off_m = (tile // tiles_n) * BLOCK_M
        off_n = (tile % tiles_n) * (2 * ROWS)
        acc = _consume_tiles(w_smem, x_smem, ready, empty, turn, s_ptr, qz_ptr, N, num_groups, 0, num_k, g, off_n,
                             row0, BLOCK_M, dtype, GROUP_SIZE, HAS_ZEROS, STAGES, PINGPONG)
        _finish_tile(acc, bias_ptr, out_ptr, M, N, off_m, off_n + row0, stride_om, HAS_BIAS, False, mma_layout)
        g += num_k


@gluon.jit
def _w4a16_sk_kernel(
    x_desc, w_desc, s_ptr, qz_ptr, bias_ptr, out_ptr, part_ptr, flag_ptr,
    M, N, num_groups, num_k, tiles_n, sk_tiles, dp_waves, stride_om,
    GROUP_SIZE: gl.constexpr, HAS_ZEROS: gl.constexpr, HAS_BIAS: gl.constexpr,
    STAGES: gl.constexpr, PDL: gl.constexpr, CONSUMER_REGS: gl.constexpr, PINGPONG: gl.constexpr,
    num_warps: gl.constexpr,
):
    """out [M, N]: the persistent, stream-K form of _w4a16_ws_kernel (one CTA per SM), the same partitions."""
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[1]
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    ROWS: gl.constexpr = BLOCK_N // 2  # the second consumer's first row
    dtype: gl.constexpr = x_desc.dtype
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, 16, BLOCK_N], w_desc.layout)
    x_smem = gl.allocate_shared_memory(dtype, [2 * STAGES, BLOCK_M, 64], x_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # one arrival per consumer warpgroup
    gl.warp_specialize([
        (_sk_consumer, (x_desc, w_smem, x_smem, ready, empty, turn, s_ptr, qz_ptr, bias_ptr, out_ptr, part_ptr,
                        flag_ptr, M, N, num_groups, num_k, tiles_n, sk_tiles, dp_waves, stride_om,
                        gl.constexpr(0), GROUP_SIZE, HAS_ZEROS, HAS_BIAS, STAGES, PINGPONG)),
        (_sk_consumer, (x_desc, w_smem, x_smem, ready, empty, turn, s_ptr, qz_ptr, bias_ptr, out_ptr, part_ptr,
                        flag_ptr, M, N, num_groups, num_k, tiles_n, sk_tiles, dp_waves, stride_om,
                        ROWS, GROUP_SIZE, HAS_ZEROS, HAS_BIAS, STAGES, PINGPONG)),
        (_sk_producer, (x_desc, w_desc, w_smem, x_smem, ready, empty, num_k, tiles_n, sk_tiles, dp_waves, STAGES,
                        PDL)),
    ], [4, 1], [CONSUMER_REGS, 40])


_PARTS: dict[int, Tensor] = {}  # device index → the stream-K workspace (fp32), grown to the largest asked


def _workspace(device: torch.device, numel: int) -> Tensor | None:
    """fp32 [numel] or more, shared by the stream-K launches of a device (one stream at a time, as the
    semaphores), or None inside a CUDA-graph capture that finds none large enough (tile_counters)."""
    index = device_index(device)
    parts = _PARTS.get(index)
    if parts is None or parts.numel() < numel:
        if torch.cuda.is_current_stream_capturing():
            return None
        parts = torch.empty(numel, dtype=torch.float32, device=device)
        _PARTS[index] = parts
    return parts


def launch_w4a16_sk(
    x: Tensor, qweight: Tensor, scales: Tensor, qzeros: Tensor | None, bias: Tensor | None, group_size: int,
    block_m: int, num_stages: int, block_n: int = WS_BLOCK_N,
) -> Tensor:
    """The persistent stream-K kernel (kind "wgmma_sk"): x [M, K] → [M, N] in x's dtype, one CTA per SM.
    Inside a CUDA-graph capture that finds no workspace or semaphores large enough, _w4a16_ws_kernel."""
    M, N = x.shape[0], qweight.shape[1]
    num_k = qweight.shape[0] // 16
    tiles_n = -(-N // block_n)
    programs, sk_tiles, waves = stream_k_plan(tiles_n * -(-M // block_m), num_k, device_num_sms(x.device))
    parts = _workspace(x.device, programs * block_n * block_m) if sk_tiles else x
    flags = tile_counters(x.device, 2 * sk_tiles) if sk_tiles else x
    if parts is None or flags is None:
        return launch_w4a16_ws(x, qweight, scales, qzeros, bias, group_size, block_m, 1, num_stages, block_n)
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    x_desc, w_desc = tma_descriptors(x, qweight, block_m, block_n)
    _w4a16_sk_kernel[(programs,)](
        x_desc, w_desc, scales, qzeros if qzeros is not None else scales, bias if bias is not None else scales, out,
        parts, flags, M, N, scales.shape[0], num_k, tiles_n, sk_tiles, waves, out.stride(0),
        GROUP_SIZE=group_columns_of(group_size, num_k), HAS_ZEROS=qzeros is not None, HAS_BIAS=bias is not None,
        STAGES=num_stages, CONSUMER_REGS=232, PINGPONG=PINGPONG, num_warps=4, **pdl_args(x.device),
    )
    return out
