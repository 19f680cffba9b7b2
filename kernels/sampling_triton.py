"""Triton argmax of each row (imported only when a kernel runs): see kernels/sampling.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .pdl_triton import pdl_args, wait_for_inputs

CHUNK = 4096  # entries of a row per program of the first kernel (a 128K vocabulary: 32 chunks)


@triton.jit
def _chunk_argmax_kernel(x_ptr, value_ptr, index_ptr, num_cols, stride_row, num_chunks, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    """Chunk c of row r: its largest entry and that entry's column (the first of equal ones)."""
    wait_for_inputs(PDL)
    row, chunk = tl.program_id(0), tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_row + offs, mask=offs < num_cols, other=float("-inf"))
    x = x.to(tl.float32)
    x = tl.where(x != x, float("inf"), x)  # NaN: above every number
    value, index = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(value_ptr + row * num_chunks + chunk, value)
    tl.store(index_ptr + row * num_chunks + chunk, chunk * BLOCK + index)


@triton.jit
def _pick_kernel(value_ptr, index_ptr, out_ptr, num_chunks, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    """Row r's argmax: the column of its first chunk with the largest value."""
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < num_chunks
    values = tl.load(value_ptr + row * num_chunks + offs, mask=mask, other=float("-inf"))
    indices = tl.load(index_ptr + row * num_chunks + offs, mask=mask, other=0)
    _, best = tl.max(values, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.sum(tl.where(offs == best, indices, 0), axis=0).to(tl.int64))


def argmax_rows(logits: Tensor) -> Tensor:
    num_rows, num_cols = logits.shape
    num_chunks = triton.cdiv(num_cols, CHUNK)
    values = torch.empty(num_rows, num_chunks, device=logits.device, dtype=torch.float32)
    indices = torch.empty(num_rows, num_chunks, device=logits.device, dtype=torch.int32)
    out = torch.empty(num_rows, device=logits.device, dtype=torch.int64)
    pdl = pdl_args(logits.device)
    _chunk_argmax_kernel[(num_rows, num_chunks)](logits, values, indices, num_cols, logits.stride(0), num_chunks,
                                                 BLOCK=CHUNK, num_warps=8, **pdl)
    _pick_kernel[(num_rows,)](values, indices, out, num_chunks, BLOCK_C=triton.next_power_of_2(num_chunks),
                              num_warps=1, **pdl)
    return out
