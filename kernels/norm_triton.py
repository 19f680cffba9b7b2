"""Triton RMSNorm, optionally fused with the residual add and with the per-token FP8 quantization of its
output (imported only when a kernel runs).

One program per row; a row of hidden_size elements is one register tile. Rows may be a 2-level
strided view ([num_tokens, num_heads, head_dim] slices of the fused qkv output for q/k norms).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .fp8_triton import quantize_row
from .pdl_triton import pdl_args, wait_for_inputs


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr, perm_ptr, hidden, inner, stride_x_outer, stride_x_inner,
    stride_res, eps, min_scale, HAS_RESIDUAL: tl.constexpr, FP8_OUT: tl.constexpr, PERM: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x_row = (row // inner) * stride_x_outer + (row % inner) * stride_x_inner
    x = tl.load(x_ptr + x_row + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # residual' = x + residual, rounded to the model dtype as the torch path does
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0).to(tl.float32))
        x = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * hidden + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
    normed = (x32 * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if PERM:  # out[j] = the normed row's element perm[j]: the same values read again in that order (from L1)
        cols = tl.load(perm_ptr + offs, mask=mask, other=0)
        x = tl.load(x_ptr + x_row + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32))
            x = x.to(res_out_ptr.dtype.element_ty)
        normed = (x.to(tl.float32) * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if FP8_OUT:  # the normed row in the model dtype (x's, which is w's here), quantized as fp8_triton does
        y = (normed * w).to(x_ptr.dtype.element_ty).to(tl.float32)
        quantize_row(y, mask, out_ptr + row * hidden + offs, scale_ptr + row, min_scale)
    else:
        tl.store(out_ptr + row * hidden + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _row_strides(x: Tensor) -> tuple[Tensor, int, int, int]:
    """(x or a copy, rows per outer index, outer stride, inner stride): rows of x as a 2-level view."""
    if x.stride(-1) != 1 or x.dim() > 3:
        x = x.contiguous()
    if x.dim() == 1:
        return x, 1, 0, 0
    if x.dim() == 2:
        return x, 1, x.stride(0), 0
    return x, x.shape[1], x.stride(0), x.stride(1)


def rms_norm(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None, perm: Tensor | None = None,
             ) -> tuple[Tensor, Tensor | None]:
    """(rms_norm(x [+ residual]), x + residual or None); outputs are new contiguous tensors. `perm` (int32
    [hidden]): the normed output's columns in that order (an act-order linear's gather, done here)."""
    out = torch.empty(x.shape, device=x.device, dtype=torch.promote_types(x.dtype, weight.dtype))
    return out, _launch(x, weight, eps, residual, out, None, 0.0, perm)


def rms_norm_fp8(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None, min_scale: float,
                 ) -> tuple[Tensor, Tensor, Tensor | None]:
    """(values, scale, x + residual or None): rms_norm(x [+ residual]) in x's dtype (weight's too),
    quantized per token as fp8_triton.quantize_fp8_per_token does, in the same kernel."""
    out = torch.empty(x.shape, device=x.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty(*x.shape[:-1], 1, device=x.device, dtype=torch.float32)
    return out, scale, _launch(x, weight, eps, residual, out, scale, min_scale)


def _launch(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None, out: Tensor, scale: Tensor | None,
            min_scale: float, perm: Tensor | None = None) -> Tensor | None:
    hidden = x.shape[-1]
    num_rows = x.numel() // hidden
    if residual is not None:
        residual = residual.reshape(num_rows, hidden)
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
    res_out = torch.empty(x.shape, device=x.device, dtype=x.dtype) if residual is not None else None
    x_rows, inner, stride_outer, stride_inner = _row_strides(x)
    if num_rows == 0:
        return res_out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(num_rows,)](
        x_rows, residual if residual is not None else x_rows, weight, out,
        res_out if res_out is not None else out, scale if scale is not None else out,
        perm if perm is not None else weight, hidden, inner, stride_outer,
        stride_inner, residual.stride(0) if residual is not None else 0, eps, min_scale,
        HAS_RESIDUAL=residual is not None, FP8_OUT=scale is not None, PERM=perm is not None, BLOCK=block,
        num_warps=min(16, max(1, block // 256)), **pdl_args(x.device),
    )
    return res_out
