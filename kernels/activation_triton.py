"""Triton SiLU(gate) · up, or GELU(gate) · up in its tanh form (ACT 1, Gemma) (imported only when a kernel
runs): one pass, no gate/up temporaries; or one
program per token that also quantizes the token's row to FP8 for a w8a8-fp8 down projection."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .fp8_triton import one_pass_warps, quantize_row
from .pdl_triton import pdl_args, wait_for_inputs

BLOCK = 1024
ACT_CODES = {"silu": 0, "gelu_pytorch_tanh": 1}


@triton.jit
def _silu_mul(gate_up_ptr, offs, mask, size, INTERLEAVE: tl.constexpr, ACT: tl.constexpr = 0):
    """act(gate) · up at the output columns offs of the row at gate_up_ptr, in float32 (not yet rounded
    to the model dtype), in activation.silu_and_mul's column order. ACT 0: SiLU; 1: GELU, tanh form
    (0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), tanh(z) as 1 - 2 / (exp(2z) + 1), z clamped to ±15)."""
    if INTERLEAVE > 0:  # runs of INTERLEAVE gate columns, then the same features' up columns
        gate_offs = (offs // INTERLEAVE) * (2 * INTERLEAVE) + offs % INTERLEAVE
        up_offs = gate_offs + INTERLEAVE
    else:
        gate_offs = offs
        up_offs = offs + size
    gate = tl.load(gate_up_ptr + gate_offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + up_offs, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        act = gate / (1.0 + tl.exp(-gate))
    else:
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2 / pi) (...)
        z = tl.minimum(tl.maximum(z, -15.0), 15.0)  # tanh is ±1 in float32 beyond: no exp overflow
        act = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))
    # rounded to the model dtype before the product, as the torch path (F.silu(gate) * up) does
    act = act.to(gate_up_ptr.dtype.element_ty).to(tl.float32)
    return act * up


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, size, stride_in, stride_out, INTERLEAVE: tl.constexpr,
                         BLOCK: tl.constexpr, PDL: tl.constexpr, ACT: tl.constexpr = 0):
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    h = _silu_mul(gate_up_ptr + token * stride_in, offs, mask, size, INTERLEAVE, ACT)
    tl.store(out_ptr + token * stride_out + offs, h.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_fp8_kernel(gate_up_ptr, out_ptr, scale_ptr, size, stride_in, min_scale,
                             INTERLEAVE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                             ACT: tl.constexpr = 0):
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)  # BLOCK >= size: the token's row stays in registers
    mask = offs < size
    h = _silu_mul(gate_up_ptr + token * stride_in, offs, mask, size, INTERLEAVE, ACT)
    # rounded to the model dtype as the unfused kernel stores it, then quantized
    h = h.to(gate_up_ptr.dtype.element_ty).to(tl.float32)
    quantize_row(h, mask, out_ptr + token * size + offs, scale_ptr + token, min_scale)


def _rows(gate_up: Tensor) -> Tensor:
    rows = gate_up.reshape(-1, gate_up.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def act_and_mul(gate_up: Tensor, act: str, interleave: int = 0) -> Tensor:
    """act(gate) · up, act a key of ACT_CODES: gate_up [..., 2 * size] → [..., size]."""
    size = gate_up.shape[-1] // 2
    rows = _rows(gate_up)
    out = torch.empty(*gate_up.shape[:-1], size, device=gate_up.device, dtype=gate_up.dtype)
    if rows.shape[0] == 0:
        return out
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(size, BLOCK))](
        rows, out, size, rows.stride(0), size, INTERLEAVE=interleave, BLOCK=BLOCK, num_warps=4,
        ACT=ACT_CODES[act], **pdl_args(gate_up.device),
    )
    return out


def act_and_mul_fp8(gate_up: Tensor, min_scale: float, act: str, interleave: int = 0) -> tuple[Tensor, Tensor]:
    """gate_up [..., 2 * size] → (values float8_e4m3fn [..., size], scale float32 [..., 1]): act(gate) · up
    (act a key of ACT_CODES) in the model dtype, quantized per token as fp8_triton.quantize_fp8_per_token does
    (size up to ONE_PASS_MAX)."""
    size = gate_up.shape[-1] // 2
    rows = _rows(gate_up)
    out = torch.empty(*gate_up.shape[:-1], size, device=gate_up.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty(*gate_up.shape[:-1], 1, device=gate_up.device, dtype=torch.float32)
    if rows.shape[0] == 0:
        return out, scale
    block = triton.next_power_of_2(size)
    _silu_and_mul_fp8_kernel[(rows.shape[0],)](
        rows, out, scale, size, rows.stride(0), min_scale, INTERLEAVE=interleave, BLOCK=block,
        num_warps=one_pass_warps(block), ACT=ACT_CODES[act], **pdl_args(gate_up.device),
    )
    return out, scale
