"""Run-time LoRA on CUDA in two Triton kernels per linear (imported only when a kernel runs): each token
multiplies by its own adapter slot's factors only (punica's shrink and expand), not by every slot's.

Layout (runtime/lora.py): A [S·rows, K] and B [S·rows, N], slot s owning rows s·rows ..+rows (rows = m·R:
m members of R zero-padded rank each); token_slot [T] int32, the token's slot or -1 (no adapter).

- shrink: parts [splits, T, rows] float32, whose sum over splits is x[t] @ A[slot_t rows]ᵀ (0 for slot -1).
  Grid (token tiles, row tiles, slots × K splits): a program computes one slot's tokens of its tile over one
  K split, and returns at once when none of its tokens names its slot (a test inside the kernel, no host
  value), so each slot's A is read once per tile and split, not once per slot present. A few-token step
  splits K so that enough programs run, each storing its own partial; the last split of a (tile, slot) to
  arrive sums them in split order (deterministic; split_k_triton's self-resetting semaphores, so no zeroing
  kernel and no second kernel), and the expand reads that one sum.
- expand: out[t] += (Σ parts[:, t]) rounded to B's dtype @ B[slot_t rows], in place; rows of slot -1 are
  neither read nor written. Grid (token tiles, column tiles); a program sums its tile's splits once, then
  for each slot its tokens name multiplies that slot's B tile by xa with the other tokens' rows zeroed.

A tile of tokens may hold several slots (a decode batch mixes requests); contiguous tokens of one request
(prefill, chunks) make most tiles one slot. Chosen over gathering A/B rows per token, which reads the factors
once per token instead of once per tile, and over sorting tokens by slot, which costs kernels and a grid
sized by the data. Session 40 measured the first form (the slot loop inside the shrink, the splits summed per
slot inside the expand, up to 2048 / T splits) at +93% of a decode step at 64 tokens over 4 adapters on an
H200, against +27% for the torch path: the expand re-read every split for every slot.

The sum between the two runs in float32 and is rounded to the model dtype before B, as the torch path's
x @ Aᵀ rounds it; float32 products stay IEEE (no TF32), as fused_moe's checking mode. Every launch shape
depends on T and the weights' shapes only, so CUDA graphs capture both kernels for each batch size.
Tile sizes and the split rule are first choices, not tuned on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import device_num_sms
from .pdl_triton import pdl_args, wait_for_inputs
from .split_k_triton import tile_counters

BLOCK_K = 64  # shrink: x columns per step
MIN_K_STEPS = 4  # shrink: a split covers at least this many BLOCK_K steps
SPLIT_TOKENS = 4096  # shrink: splits × T stays at or below this (the fp32 partials' size)


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slot_ptr, part_ptr, xa_ptr, counter_ptr, T, K, rows, num_slots, k_per_split, splits,
                   stride_xm, stride_xk, stride_am, PRECISION: tl.constexpr, SUM_SPLITS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """parts[split, the tile's tokens of slot s, the tile's rows] = x [BLOCK_M, split's K] @ A[s's rows]ᵀ; the
    program of slot 0 also writes the zeros of the tile's tokens without a slot. SUM_SPLITS: the last of a
    (tile, slot)'s splits to arrive at its semaphore sums them all into xa and puts the semaphore back to 0."""
    pid_m, pid_r, pid_sk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s, pid_k = pid_sk % num_slots, pid_sk // num_slots
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, r_mask = offs_m < T, offs_r < rows
    k_begin = pid_k * k_per_split
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    wait_for_inputs(PDL)
    slots = tl.load(slot_ptr + offs_m, mask=m_mask, other=-1)
    mine = slots == s
    if tl.max(mine.to(tl.int32), axis=0) > 0:  # a slot none of the tile's tokens names reads nothing
        a_rows = (s * rows + offs_r).to(tl.int64) * stride_am
        for k0 in range(k_begin, tl.minimum(k_begin + k_per_split, K), BLOCK_K):
            k_mask = k0 + offs_k < K
            x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k0 + offs_k)[None, :] * stride_xk,
                        mask=mine[:, None] & k_mask[None, :], other=0.0)
            a = tl.load(a_ptr + a_rows[None, :] + (k0 + offs_k)[:, None],
                        mask=r_mask[None, :] & k_mask[:, None], other=0.0)  # [BLOCK_K, BLOCK_R]
            acc = tl.dot(x.to(a.dtype), a, acc, input_precision=PRECISION)
    none = (slots < 0) | (slots >= num_slots)
    writes = (mine | (none & (s == 0))) & m_mask
    mask = writes[:, None] & r_mask[None, :]
    offs = offs_m[:, None].to(tl.int64) * rows + offs_r[None, :]
    tl.store(part_ptr + pid_k * T * rows + offs, acc, mask=mask)
    if SUM_SPLITS:
        tl.debug_barrier()  # every thread's partial is stored before the count is released
        tile = (pid_m * tl.num_programs(1) + pid_r) * num_slots + s
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:
            total = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for split in range(splits):  # in split order: the same sum on every run
                total += tl.load(part_ptr + split * T * rows + offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(xa_ptr + offs, total, mask=mask)
            tl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def _expand_kernel(part_ptr, b_ptr, slot_ptr, out_ptr, T, N, rows, num_slots, splits,
                   stride_bm, stride_om, stride_on, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    """out[tile's tokens with a slot, tile's columns] += xa [BLOCK_M, rows] @ B[each token's slot's rows]: the
    splits summed once for the tile, then one product per slot present, the other tokens' rows zeroed."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    m_mask, n_mask = offs_m < T, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    wait_for_inputs(PDL)
    slots = tl.load(slot_ptr + offs_m, mask=m_mask, other=-1)
    keep = (slots >= 0) & (slots < num_slots)
    for r0 in range(0, rows, BLOCK_R):
        r_mask = r0 + offs_r < rows
        xa = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for split in range(splits):  # in split order: the same sum on every run
            xa += tl.load(part_ptr + (split * T + offs_m[:, None]).to(tl.int64) * rows + (r0 + offs_r)[None, :],
                          mask=keep[:, None] & r_mask[None, :], other=0.0)
        xa = xa.to(b_ptr.dtype.element_ty)
        for s in range(num_slots):
            mine = slots == s
            if tl.max(mine.to(tl.int32), axis=0) > 0:
                b = tl.load(b_ptr + (s * rows + r0 + offs_r)[:, None].to(tl.int64) * stride_bm + offs_n[None, :],
                            mask=r_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
                acc = tl.dot(tl.where(mine[:, None], xa, tl.zeros_like(xa)), b, acc, input_precision=PRECISION)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    mask = keep[:, None] & n_mask[None, :]
    out = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (out + acc).to(out_ptr.dtype.element_ty), mask=mask)


def _block(size: int, low: int, high: int) -> int:
    return min(high, max(low, triton.next_power_of_2(size)))


def _precision(t: Tensor) -> str:
    return "ieee" if t.dtype == torch.float32 else "tf32"  # (16-bit operands ignore it)


def _programs(device: torch.device) -> int:
    return device_num_sms(device) if device.type == "cuda" else 4


def shrink_splits(num_tokens: int, k: int, tiles: int, programs: int) -> int:
    """K splits of the shrink: enough programs to fill `programs` SMs over `tiles` output tiles, each split at
    least MIN_K_STEPS steps of BLOCK_K, and splits × num_tokens at most SPLIT_TOKENS."""
    most = min(triton.cdiv(k, MIN_K_STEPS * BLOCK_K), max(1, SPLIT_TOKENS // max(num_tokens, 1)))
    return max(1, min(programs // tiles, most))


def lora_shrink(x: Tensor, a: Tensor, token_slot: Tensor, num_slots: int, splits: int | None = None,
                sum_splits: bool = True) -> Tensor:
    """x [T, K] (any strides), A [S·rows, K] (unit stride along K), token_slot [T] int32 (-1: none) →
    parts [splits, T, rows] float32 whose sum over dim 0 is x[t] @ A[slot_t·rows ..+rows]ᵀ (zeros for -1): one
    part, the sum itself, when K is not split or the kernel summed its splits (split_k_triton's semaphores;
    none while a CUDA graph is captured before any were made).
    splits: the K splits (default shrink_splits; fewer if K has fewer steps of BLOCK_K). sum_splits False: the
    partials as they are (the expand sums them)."""
    num_tokens, k = x.shape
    rows = a.shape[0] // num_slots
    assert a.shape == (num_slots * rows, k) and a.stride(1) == 1 and token_slot.dtype == torch.int32
    if num_tokens == 0:
        return torch.empty(1, 0, rows, device=x.device, dtype=torch.float32)
    block_m = _block(num_tokens, 16, 64)
    block_r = _block(rows, 16, 64)
    tiles = triton.cdiv(num_tokens, block_m) * triton.cdiv(rows, block_r) * min(num_slots, num_tokens)  # that work
    if splits is None:
        splits = shrink_splits(num_tokens, k, tiles, _programs(x.device))
    steps_per_split = triton.cdiv(triton.cdiv(k, BLOCK_K), splits)
    splits = triton.cdiv(triton.cdiv(k, BLOCK_K), steps_per_split)  # none empty
    parts = torch.empty(splits, num_tokens, rows, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(rows, block_r), num_slots * splits)
    counters = tile_counters(x.device, grid[0] * grid[1] * num_slots) if splits > 1 and sum_splits else None
    xa = parts[:1] if counters is None else torch.empty(1, num_tokens, rows, device=x.device, dtype=torch.float32)
    _shrink_kernel[grid](
        x, a, token_slot, parts, xa, parts if counters is None else counters, num_tokens, k, rows, num_slots,
        steps_per_split * BLOCK_K, splits, x.stride(0), x.stride(1), a.stride(0), PRECISION=_precision(a),
        SUM_SPLITS=counters is not None, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=BLOCK_K, num_warps=4,
        **pdl_args(x.device),
    )
    return parts if counters is None else xa


def lora_expand(out: Tensor, parts: Tensor, b: Tensor, token_slot: Tensor, num_slots: int) -> Tensor:
    """out [T, N] (any strides) += (Σ parts [splits, T, rows] over splits, in B's dtype) @ B[slot_t·rows ..+rows],
    B [S·rows, N] (unit stride along N), in place; rows of tokens with slot -1 untouched. Returns out."""
    num_tokens, n = out.shape
    splits, _, rows = parts.shape
    assert parts.shape[1] == num_tokens and parts.is_contiguous() and parts.dtype == torch.float32
    assert b.shape == (num_slots * rows, n) and b.stride(1) == 1 and token_slot.dtype == torch.int32
    if num_tokens == 0:
        return out
    block_m = _block(num_tokens, 16, 64)
    block_n = 64 if num_tokens <= 16 else 128
    block_r = _block(rows, 16, 64)
    grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(n, block_n))
    _expand_kernel[grid](
        parts, b, token_slot, out, num_tokens, n, rows, num_slots, splits,
        b.stride(0), out.stride(0), out.stride(1), PRECISION=_precision(b),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, num_warps=4, **pdl_args(out.device),
    )
    return out


def lora_add(out: Tensor, x: Tensor, a: Tensor, b: Tensor, token_slot: Tensor, num_slots: int) -> Tensor:
    """out [T, N] += x [T, K] @ A[slot_t rows]ᵀ @ B[slot_t rows] per token (slot -1: nothing), in place, in two
    kernels (lora_shrink, lora_expand). token_slot may be longer than T (its first T entries are read)."""
    slots = token_slot[: x.shape[0]]
    return lora_expand(out, lora_shrink(x, a, slots, num_slots), b, slots, num_slots)
