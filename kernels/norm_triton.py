"""Triton RMSNorm, optionally fused with the residual add and with the FP8 quantization of its output, per token
(w8a8-fp8) or per token and group of columns (w8a8-fp8-block) (imported only when a kernel runs).

One program per row; a row of hidden_size elements is one register tile. Rows may be a 2-level
strided view ([num_tokens, num_heads, head_dim] slices of the fused qkv output for q/k norms).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .fp8_triton import empty_group_outputs, quantize_groups, quantize_row
from .pdl_triton import pdl_args, wait_for_inputs


@triton.jit(do_not_specialize=["num_rows"])  # read only with GROUP: no compiled variant of its own for 1 token
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr, perm_ptr, hidden, inner, stride_x_outer, stride_x_inner,
    stride_res, eps, min_scale, num_rows, HAS_RESIDUAL: tl.constexpr, FP8_OUT: tl.constexpr, PERM: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr, GROUP: tl.constexpr = 0,
):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    if GROUP > 0:  # rows past num_rows (the padding to cuBLAS's multiple of 4) read nothing: zeros
        row_mask = mask & (row < num_rows)
    else:
        row_mask = mask
    x_row = (row // inner) * stride_x_outer + (row % inner) * stride_x_inner
    x = tl.load(x_ptr + x_row + offs, mask=row_mask, other=0.0)
    if HAS_RESIDUAL:  # residual' = x + residual, rounded to the model dtype as the torch path does
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_res + offs, mask=row_mask, other=0.0).to(tl.float32))
        x = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * hidden + offs, x, mask=row_mask)
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
    if FP8_OUT and GROUP > 0:  # the same row as a [BLOCK / GROUP, GROUP] tile, quantized per group as fp8_triton does
        y = tl.reshape((normed * w).to(x_ptr.dtype.element_ty).to(tl.float32), (BLOCK // GROUP, GROUP))
        groups = tl.arange(0, BLOCK // GROUP)
        columns = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        scale_ptrs = scale_ptr + groups * tl.num_programs(0) + row  # a group's scales contiguous over the rows
        quantize_groups(y, columns < hidden, out_ptr + row * hidden + columns, scale_ptrs, groups * GROUP < hidden,
                        min_scale)
    elif FP8_OUT:  # the normed row in the model dtype (x's, which is w's here), quantized as fp8_triton does
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


def rms_norm_fp8_groups(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None, min_scale: float,
                        group_size: int, rows: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """(values [rows, hidden], scale [rows, ceil(hidden / group_size)] with strides (1, rows), x + residual or None):
    rms_norm(x [+ residual]) in x's dtype (weight's too) quantized per token and group_size columns as
    fp8_triton.quantize_fp8_per_token_group(..., rows=rows) does, in the same kernel; rows >= the tokens (the rows
    past them zeros at the smallest scale)."""
    out, scale = empty_group_outputs(rows, x.shape[-1], group_size, x.device)
    return out, scale, _launch(x, weight, eps, residual, out, scale, min_scale, group_size=group_size, rows=rows)


def _launch(x: Tensor, weight: Tensor, eps: float, residual: Tensor | None, out: Tensor, scale: Tensor | None,
            min_scale: float, perm: Tensor | None = None, group_size: int = 0, rows: int | None = None,
            ) -> Tensor | None:
    hidden = x.shape[-1]
    num_rows = x.numel() // hidden
    if residual is not None:
        residual = residual.reshape(num_rows, hidden)
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
    res_out = torch.empty(x.shape, device=x.device, dtype=x.dtype) if residual is not None else None
    x_rows, inner, stride_outer, stride_inner = _row_strides(x)
    grid_rows = num_rows if rows is None else rows
    if grid_rows == 0:
        return res_out
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(grid_rows,)](
        x_rows, residual if residual is not None else x_rows, weight, out,
        res_out if res_out is not None else out, scale if scale is not None else out,
        perm if perm is not None else weight, hidden, inner, stride_outer,
        stride_inner, residual.stride(0) if residual is not None else 0, eps, min_scale, num_rows,
        HAS_RESIDUAL=residual is not None, FP8_OUT=scale is not None, PERM=perm is not None, BLOCK=block,
        GROUP=min(group_size, block),  # a row narrower than the group is one (partial) group
        num_warps=min(16, max(1, block // 256)), **pdl_args(x.device),
    )
    return res_out
