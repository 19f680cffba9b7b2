"""Split-K GEMMs (imported only when a kernel runs): the split plan and the second pass, where the
fp32 partials of each K split are summed in split order (deterministic, unlike atomics) and cast to
the output dtype. Shared by the W4A16 kernels (Triton and Gluon) and the FP8 few-token kernel."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


def plan_splits(num_chunks: int, split_k: int, m: int, n: int, like: Tensor, dtype: torch.dtype):
    """K in `num_chunks` chunks (tiles, blocks) over at most `split_k` splits, none empty →
    (chunks per split, splits, out [m, n] in dtype, target): target is out itself, or the fp32
    partials [splits, m, n] for `reduce_splits` when K is split."""
    chunks_per_split = triton.cdiv(num_chunks, split_k)
    split_k = triton.cdiv(num_chunks, chunks_per_split)
    out = torch.empty(m, n, device=like.device, dtype=dtype)
    target = torch.empty(split_k, m, n, device=like.device, dtype=torch.float32) if split_k > 1 else out
    return chunks_per_split, split_k, out, target


@triton.jit
def _split_reduce_kernel(
    part_ptr, bias_ptr, out_ptr, M, N, num_splits, stride_split, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    """out[m, n] = sum over splits of the fp32 partials (+ bias), in the output dtype."""
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
        HAS_BIAS=bias is not None, BLOCK=block,
    )
