"""Triton per-token dynamic FP8 (E4M3) activation quantization (imported only when a kernel runs).

One program per token: pass 1 takes the row's absmax, pass 2 divides by the scale, saturates to
±448 and casts (round to nearest even). The row's second read hits L1/L2, so HBM traffic is the
16-bit row in, the fp8 row and one float32 scale out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

FP8_E4M3_MAX = tl.constexpr(448.0)
MAX_BLOCK = 4096


@triton.jit
def _quantize_fp8_per_token_kernel(
    x_ptr, out_ptr, scale_ptr, size, stride_x, min_scale, BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    absmax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, size, BLOCK):
        x = tl.load(x_ptr + token * stride_x + start + offs, mask=start + offs < size, other=0.0)
        absmax = tl.maximum(absmax, tl.abs(x.to(tl.float32)))
    scale = tl.maximum(tl.math.div_rn(tl.max(absmax, axis=0), FP8_E4M3_MAX), min_scale)
    tl.store(scale_ptr + token, scale)
    for start in range(0, size, BLOCK):
        mask = start + offs < size
        x = tl.load(x_ptr + token * stride_x + start + offs, mask=mask, other=0.0).to(tl.float32)
        # div_rn: IEEE division as torch does; the default fp32 division is approximate and moves
        # quotients that sit on an e4m3 rounding tie
        y = tl.clamp(tl.math.div_rn(x, scale), -FP8_E4M3_MAX, FP8_E4M3_MAX)
        tl.store(out_ptr + token * size + start + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def quantize_fp8_per_token(x: Tensor, min_scale: float) -> tuple[Tensor, Tensor]:
    """x [..., K] → (fp8 [..., K], scale [..., 1] float32)."""
    size = x.shape[-1]
    rows = x.reshape(-1, size)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(x.shape, device=x.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty(*x.shape[:-1], 1, device=x.device, dtype=torch.float32)
    if rows.shape[0] == 0:
        return out, scale
    block = min(MAX_BLOCK, triton.next_power_of_2(size))
    _quantize_fp8_per_token_kernel[(rows.shape[0],)](
        rows, out, scale, size, rows.stride(0), min_scale, BLOCK=block, num_warps=4 if block <= 2048 else 8,
    )
    return out, scale
