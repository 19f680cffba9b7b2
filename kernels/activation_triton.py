"""Triton SiLU(gate) · up (imported only when a kernel runs): one pass, no gate/up temporaries."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .pdl_triton import pdl_args, wait_for_inputs

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, size, stride_in, stride_out, INTERLEAVE: tl.constexpr,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    if INTERLEAVE > 0:  # runs of INTERLEAVE gate columns, then the same features' up columns
        gate_offs = (offs // INTERLEAVE) * (2 * INTERLEAVE) + offs % INTERLEAVE
        up_offs = gate_offs + INTERLEAVE
    else:
        gate_offs = offs
        up_offs = offs + size
    gate = tl.load(gate_up_ptr + token * stride_in + gate_offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + token * stride_in + up_offs, mask=mask, other=0.0).to(tl.float32)
    # silu rounded to the model dtype before the product, as the torch path (F.silu(gate) * up) does
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + token * stride_out + offs, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: Tensor, interleave: int = 0) -> Tensor:
    """gate_up [..., 2 * size] → [..., size] (activation.silu_and_mul's column orders)."""
    size = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * size)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*gate_up.shape[:-1], size, device=gate_up.device, dtype=gate_up.dtype)
    if rows.shape[0] == 0:
        return out
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(size, BLOCK))](
        rows, out, size, rows.stride(0), size, INTERLEAVE=interleave, BLOCK=BLOCK, num_warps=4,
        **pdl_args(gate_up.device),
    )
    return out
