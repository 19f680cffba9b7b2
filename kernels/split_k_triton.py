"""The second pass of a split-K GEMM (imported only when a kernel runs): the fp32 partials of each
K split, summed in split order (deterministic, unlike atomics) and cast to the output dtype. Shared by
the W4A16 kernels and the FP8 few-token kernel."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


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
