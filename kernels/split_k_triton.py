"""Split-K GEMMs (imported only when a kernel runs): the split plan and the sum of the splits' fp32
partials, in split order (deterministic, unlike atomics on the output), cast to the output dtype.
Shared by the W4A16 kernels (Triton and Gluon) and the FP8 few-token kernel.

For tiles of at most 16 tokens (the decode GEMVs) the sum runs inside the GEMM kernel: each program
stores its partial, then counts itself on its output tile's semaphore (an int32 in `tile_counters`,
zero between kernels); the last of a tile's splits to arrive loads all the partials at once, sums
them and writes the tile, then puts the semaphore back to zero. That saves the second kernel. Larger
tiles keep it (`reduce_splits`): one program reading every split of a 128 x 256 tile took longer than
a second kernel spread over the GPU (H100, benchmarks/RESULTS.md, session 12). So does a split GEMM
that finds no semaphores (the first of a device inside a CUDA-graph capture, which cannot allocate
outside its pool).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import device_index
from .pdl_triton import pdl_args, wait_for_inputs

_COUNTERS: dict[int, Tensor] = {}  # device index → int32 semaphores, all zero between kernels
_MIN_COUNTERS = 65536  # output tiles: 28672 / 64 columns × 1024 / 16 tokens fits
SUM_IN_KERNEL_MAX_TOKENS = 16  # token tiles up to this many rows sum their splits in the GEMM kernel


def tile_counters(device: torch.device, num_tiles: int) -> Tensor | None:
    """int32 zeros, at least one per output tile, shared by the split GEMMs of a device (kernels of one
    stream run one after the other, and CUDA graphs keep the pointer they were captured with; two
    streams running split GEMMs at the same time would need their own), or None while a CUDA graph is
    being captured and there are none large enough (an allocation there belongs to the graph's pool;
    the engine's eager warm-up before capture allocates them)."""
    if device.type != "cuda":  # Triton's interpreter (the CPU tests)
        return torch.zeros(num_tiles, dtype=torch.int32, device=device)
    index = device_index(device)
    counters = _COUNTERS.get(index)
    if counters is None or counters.numel() < num_tiles:
        if torch.cuda.is_current_stream_capturing():
            return None
        counters = torch.zeros(max(_MIN_COUNTERS, num_tiles), dtype=torch.int32, device=device)
        _COUNTERS[index] = counters
    return counters


def plan_splits(num_chunks: int, split_k: int, m: int, n: int, like: Tensor, dtype: torch.dtype,
                num_out_tiles: int = 0, token_tile: int = 1, out_columns: int | None = None):
    """K in `num_chunks` chunks (tiles, blocks) over at most `split_k` splits, none empty →
    (chunks per split, splits, out [m, out_columns (n)] in dtype, target, counters): target is out
    itself, or the fp32 partials [splits, m, n] when K is split; counters the semaphores of the
    `num_out_tiles` output tiles (of `token_tile` tokens each) when the kernel sums its splits itself,
    else None (not split, tiles too large, or none to be had: `finish_splits` runs the second kernel)."""
    chunks_per_split = triton.cdiv(num_chunks, split_k)
    split_k = triton.cdiv(num_chunks, chunks_per_split)
    out = torch.empty(m, n if out_columns is None else out_columns, device=like.device, dtype=dtype)
    if split_k == 1:
        return chunks_per_split, split_k, out, out, None
    target = torch.empty(split_k, m, n, device=like.device, dtype=torch.float32)
    is_small = num_out_tiles and token_tile <= SUM_IN_KERNEL_MAX_TOKENS
    counters = tile_counters(like.device, num_out_tiles) if is_small else None
    return chunks_per_split, split_k, out, target, counters


def finish_splits(target: Tensor, counters: Tensor | None, bias: Tensor | None, out: Tensor) -> None:
    """After a GEMM launched per `plan_splits`: the second kernel where K was split and the GEMM did
    not sum the splits itself."""
    if target is not out and counters is None:
        reduce_splits(target, bias, out)


@triton.jit
def store_split(acc, part_ptr, out_ptr, bias_ptr, counter_ptr, offs_m, offs_n, m_mask, n_mask, stride_om,
                stride_split, HAS_BIAS: tl.constexpr, SPLITS: tl.constexpr):
    """This split's partial acc [BLOCK_M, BLOCK_N] (fp32) into part_ptr; the last split of the tile
    to arrive sums all of them in split order (+ bias) into out_ptr and resets the tile's counter.
    The grid is (N tiles, splits, token tiles), as in every split-K kernel here."""
    tile = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
    offs = offs_m[:, None] * stride_om + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    tl.store(part_ptr + tl.program_id(1) * stride_split + offs, acc, mask=mask)
    tl.debug_barrier()  # every thread's partial is stored before the count is released
    arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if arrived == SPLITS - 1:
        total = tl.zeros(acc.shape, dtype=tl.float32)
        for split in tl.static_range(SPLITS):  # unrolled: all the loads in flight at once
            total += tl.load(part_ptr + split * stride_split + offs, mask=mask, other=0.0, cache_modifier=".cg")
        if HAS_BIAS:
            total += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def _split_reduce_kernel(
    part_ptr, bias_ptr, out_ptr, M, N, num_splits, stride_split, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """out[m, n] = sum over splits of the fp32 partials (+ bias), in the output dtype."""
    wait_for_inputs(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in range(num_splits):
        total += tl.load(part_ptr + split * stride_split + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + (offs // N) * stride_om + offs % N, total.to(out_ptr.dtype.element_ty), mask=mask)


def reduce_splits(partials: Tensor, bias: Tensor | None, out: Tensor) -> None:
    """out [M, N] = partials [splits, M, N] (fp32, contiguous) summed over splits, + bias."""
    num_splits, M, N = partials.shape
    block = 1024
    _split_reduce_kernel[(triton.cdiv(M * N, block),)](
        partials, bias if bias is not None else partials, out, M, N, num_splits, M * N, out.stride(0),
        HAS_BIAS=bias is not None, BLOCK=block, **pdl_args(out.device),
    )
