"""GPTQ (Frantar et al. 2022): integer quantization that compensates each column's rounding error.

The caller (the compiler's layer-by-layer calibration) accumulates H = 2 XᵀX / n of the linear's
inputs with `HessianAccumulator` and calls `gptq_quantize` once per weight. Scales and zeros follow
`rtn`'s convention, so the result packs into the same integer formats as round-to-nearest.

Act-order (`act_order=True`) quantizes columns by decreasing H_ii, the most-used inputs first while
most freedom is left to compensate them. With static groups (the default), group parameters are
computed up front from the original weight, per ORIGINAL column index: the stored groups are then
plain i // group_size, g_idx stays None and the runtime needs neither a permutation nor a g_idx.
With `static_groups=False`, groups follow the quantization order instead and `g_idx` is returned.

Group parameters: each group's range is searched (`search_qparams`) over clip ratios 1 … 0.75 for
the smallest rounding error weighted by H_ii, the diagonal of the Hessian (how much each input
column's error costs at the output); min-max ranges are ratio 1, always a candidate. Per-channel
quantization keeps min-max ranges. On ref-llama-12m (heldout.txt, benchmarks/RESULTS.md) the search
took W4 g128 from 50.24 to 50.20 and W3 g128 from 52.20 to 51.49, but per channel it raised W4
from 50.19 to 50.39: one range spans the whole row there, and clipping its outliers costs more on
unseen text than GPTQ's compensation recovers.

Float targets (`float_target_weight`, on by default in the compiler): the inputs x̃ a linear sees come
from the already-quantized layers before it, but the output it should reproduce is the float model's
W·x. GPTQ then runs on W*, the least-squares weight from x̃ to W·x, which makes it minimize the error
against the float model instead of against the float layer on drifted inputs (GPTAQ's asymmetric
calibration). Measured on ref-llama-12m over three calibration draws (benchmarks/quality_variance.sh):
W4 per channel 50.22 on average instead of 50.32, W3 g128 51.45 instead of 51.75, W4 g128 50.11
instead of 50.06 (within the draws' spread of about ±0.1).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from llmc.errors import RecipeError
from llmc.quant.formats import QuantizedWeight, num_groups_of
from llmc.quant.rtn import check_bits, compute_qparams, dequantize_levels, quantize_levels

logger = logging.getLogger("llmc")

_MAX_DAMP_ATTEMPTS = 6
CLIP_RATIOS = torch.linspace(1.0, 0.75, 11).tolist()  # candidate group ranges, min-max first


class HessianAccumulator:
    """Running H = 2/n Σ x̃ᵀx̃ over all n input rows x̃ seen, so calibration batches can stream.

    With float targets (`with_drift=True`) each batch also brings x, the same linear's input in the
    unquantized model, and D = 2/n Σ (x − x̃)ᵀx̃ accumulates alongside: see `float_target_weight`.
    """

    def __init__(self, in_features: int, device: torch.device | str | None = None, with_drift: bool = False) -> None:
        self.hessian = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.drift = torch.zeros_like(self.hessian) if with_drift else None
        self.num_samples = 0

    def add_batch(self, x: Tensor, x_float: Tensor | None = None) -> None:
        """x [..., in_features]: every leading index is one sample (token); x_float: the float model's
        input for the same tokens (given exactly when the accumulator tracks drift)."""
        if (x_float is None) != (self.drift is None):
            raise ValueError("x_float is given exactly when the accumulator was made with_drift")
        rows = x.reshape(-1, x.shape[-1]).to(self.hessian.device, torch.float32)  # [num_tokens, in]
        total = self.num_samples + rows.shape[0]
        if total == 0:
            return
        # Rescale instead of summing then dividing: keeps H at a data-independent magnitude.
        keep, weight = self.num_samples / total, math.sqrt(2 / total)
        self.hessian *= keep
        self.hessian += (rows * weight).T @ (rows * weight)
        if self.drift is not None:
            float_rows = x_float.reshape(rows.shape).to(rows.device, torch.float32)  # [num_tokens, in]
            self.drift *= keep
            self.drift += ((float_rows - rows) * weight).T @ (rows * weight)
        self.num_samples = total


def float_target_weight(weight: Tensor, hessian: Tensor, drift: Tensor, damp_percent: float) -> Tensor:
    """The weight that best gives the float model's output from the quantized model's inputs:
    W* = W + W·D·(H + λI)⁻¹, with D = 2/n Σ (x − x̃)ᵀx̃ and H = 2/n Σ x̃ᵀx̃.

    The layer's inputs x̃ come from the already-quantized layers before it; the unquantized model
    saw x. W* is the least-squares weight that maps x̃ to the float output W·x over the calibration
    tokens (λ as GPTQ's dampening, so W* = W when x̃ = x). Because ‖Ŵx̃ − Wx‖² = ‖(Ŵ − W*)x̃‖² + const,
    GPTQ or AWQ run on W* with H minimize the error against the float model's output, correcting the
    drift the earlier layers' quantization caused (GPTAQ's asymmetric calibration, Li et al. 2025).
    weight [out, in]; hessian, drift [in, in] from one `HessianAccumulator` → float32 [out, in].
    """
    h = hessian.double()
    damp = damp_percent * torch.diagonal(h).mean()
    if damp <= 0:  # the inputs were all zero: nothing to correct
        return weight.float()
    identity = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    correction = torch.linalg.solve(h + damp * identity, drift.double().T).T  # D (H + λI)⁻¹: [in, in]
    w = weight.to(h.device, torch.float64)
    return (w + w @ correction).float()


def _drop_dead_columns(weight: Tensor, hessian: Tensor) -> tuple[Tensor, Tensor]:
    """Inputs that were always 0 (H_ii == 0) carry no information: W[:, i] = 0, and H_ii = 1 keeps H
    invertible."""
    w = weight.float().clone()  # [out, in]
    h = hessian.to(w.device, torch.float64).clone()  # [in, in]
    if not torch.isfinite(h).all():
        raise RecipeError("GPTQ: the Hessian has NaN/inf entries; check the model's calibration activations")
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    return w, h


def _inverse_hessian_cholesky(h: Tensor, damp_percent: float) -> Tensor:
    """Upper Cholesky factor of (H + λI)⁻¹, λ = damp_percent × mean diag H, raising λ until it exists."""
    identity = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    damp = damp_percent * torch.diagonal(h).mean().item()
    for _ in range(_MAX_DAMP_ATTEMPTS):
        lower, info = torch.linalg.cholesky_ex(h + damp * identity)
        if info.item() == 0:
            upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
            if info.item() == 0:
                return upper.float()
        logger.warning("GPTQ: Hessian not positive definite with dampening %.3g; retrying with 10x", damp)
        damp = max(damp * 10, 1e-8)
    raise RecipeError(
        f"GPTQ: Hessian not positive definite even with dampening {damp:.3g}; "
        "raise damp_percent or check the calibration data"
    )


def search_qparams(
    w: Tensor, importance: Tensor, bits: int, symmetric: bool, scale_dtype: torch.dtype | None,
    ratios: list[float] = CLIP_RATIOS,
) -> tuple[Tensor, Tensor | None]:
    """Scale and zero over the last dim of w [..., k] (like `compute_qparams`) with the range clipped
    by the ratio in `ratios` whose rounding error, Σ importance · (w − ŵ)², is smallest per group.
    importance [k] or broadcastable to w: H_ii of each column. ratios [1.0]: min-max ranges."""
    best_error = best_scales = best_zeros = None
    for ratio in ratios:
        scales, zeros = compute_qparams(w, bits, symmetric, ratio, scale_dtype)  # [...]
        z = None if zeros is None else zeros.unsqueeze(-1)
        levels = quantize_levels(w, scales.unsqueeze(-1), z, bits)
        error = ((w - dequantize_levels(levels, scales.unsqueeze(-1), z, bits)).pow(2) * importance).sum(-1)
        if best_error is None:
            best_error, best_scales, best_zeros = error, scales, zeros
            continue
        is_better = error < best_error  # ties keep the wider range
        best_error = torch.where(is_better, error, best_error)
        best_scales = torch.where(is_better, scales, best_scales)
        if zeros is not None:
            best_zeros = torch.where(is_better, zeros, best_zeros)
    return best_scales, best_zeros


@dataclass
class _GroupTable:
    """Every group's scale and zero, and which group each quantization position belongs to."""

    scales: Tensor  # [out, num_groups] float32
    zeros: Tensor | None  # [out, num_groups] int32; None = symmetric
    group_of_position: list[int]  # [in] group of the column quantized at each position
    is_fresh: bool  # True: a group's parameters are taken when its first column is reached
    importance: Tensor  # [in] H_ii of the column at each quantization position


def _group_table(
    w: Tensor,
    h_diag: Tensor,
    perm: Tensor,
    bits: int,
    group_size: int,
    symmetric: bool,
    is_static: bool,
    scale_dtype: torch.dtype | None,
) -> _GroupTable:
    """Static tables are filled up front from the original columns (group of column c is c // group_size);
    fresh ones get filled by `_quantize_columns`, groups then following the quantization order."""
    num_out, num_in = w.shape
    num_groups = num_groups_of(num_in, group_size)
    if is_static:
        importance = h_diag.reshape(num_groups, -1)  # [G, group columns], broadcast over the rows
        ratios = CLIP_RATIOS if group_size > 0 else [1.0]  # per channel: min-max (see the module docstring)
        scales, zeros = search_qparams(w.reshape(num_out, num_groups, -1), importance, bits, symmetric, scale_dtype,
                                       ratios)
    else:
        scales = torch.zeros(num_out, num_groups, dtype=torch.float32, device=w.device)
        zeros = None if symmetric else torch.zeros(num_out, num_groups, dtype=torch.int32, device=w.device)
    columns = perm if is_static else torch.arange(num_in, device=w.device)
    group_of_position = columns // group_size if group_size > 0 else torch.zeros_like(columns)
    return _GroupTable(scales, zeros, group_of_position.tolist(), not is_static, h_diag[perm])


def _quantize_columns(
    w: Tensor,
    hinv: Tensor,
    table: _GroupTable,
    bits: int,
    block_size: int,
    group_size: int,
    scale_dtype: torch.dtype | None,
) -> Tensor:
    """Quantize w [out, in] (already in quantization order) in place; returns levels int32 [out, in].

    NOTE: column j is rounded, and its error divided by hinv[j, j] is spread over the columns not yet
    quantized through row j of the inverse Hessian's Cholesky factor (the optimal update for the
    layer-output error). Lazy batching: the update is applied inside a block of columns at once and
    to the columns after the block by one matmul per block — the same arithmetic, fewer passes over
    W. With fresh group parameters, a group's scale/zero is taken from the error-updated columns when
    its first column is reached; blocks are whole groups so that these columns are all up to date.
    """
    num_columns = w.shape[1]
    levels = torch.empty(w.shape, dtype=torch.int32, device=w.device)  # [out, in]
    for start in range(0, num_columns, block_size):
        end = min(start + block_size, num_columns)
        block = w[:, start:end].clone()  # [out, count]
        errors = torch.zeros_like(block)
        hinv_block = hinv[start:end, start:end]  # [count, count]
        for i in range(end - start):
            group = table.group_of_position[start + i]
            if table.is_fresh and (start + i) % group_size == 0:
                first = start + i
                scale, zero = search_qparams(block[:, i : i + group_size], table.importance[first : first + group_size],
                                             bits, table.zeros is None, scale_dtype)
                table.scales[:, group] = scale
                if table.zeros is not None:
                    table.zeros[:, group] = zero
            scale = table.scales[:, group]  # [out]
            zero = None if table.zeros is None else table.zeros[:, group]
            column = block[:, i]  # [out]
            levels[:, start + i] = quantize_levels(column, scale, zero, bits)
            error = (column - dequantize_levels(levels[:, start + i], scale, zero, bits)) / hinv_block[i, i]
            block[:, i:] -= error.unsqueeze(1) * hinv_block[i, i:].unsqueeze(0)
            errors[:, i] = error
        w[:, end:] -= errors @ hinv[start:end, end:]
    return levels


def gptq_quantize(
    weight: Tensor,
    hessian: Tensor,
    bits: int,
    group_size: int,
    symmetric: bool,
    *,
    act_order: bool = False,
    static_groups: bool = True,
    damp_percent: float = 0.01,
    block_size: int = 128,
    scale_dtype: torch.dtype | None = None,
) -> QuantizedWeight:
    """GPTQ: weight [out, in] and hessian [in, in] (H = 2 XᵀX / n) → QuantizedWeight.

    group_size -1 = per output channel. scale_dtype: the dtype scales will be stored in (rounded to
    it before rounding the weights). `g_idx` is set only for act_order with static_groups=False.
    """
    check_bits(bits)
    num_in = weight.shape[1]
    num_groups_of(num_in, group_size)  # a group size that does not divide in_features is a recipe error
    w, h = _drop_dead_columns(weight, hessian)
    if act_order:  # most-used inputs first: the most freedom is left to compensate them
        perm = torch.argsort(torch.diagonal(h), descending=True, stable=True)
    else:
        perm = torch.arange(num_in, device=w.device)
    is_static = group_size == -1 or (act_order and static_groups)
    table = _group_table(w, torch.diagonal(h).float().to(w.device), perm, bits, group_size, symmetric, is_static,
                         scale_dtype)
    hinv = _inverse_hessian_cholesky(h[perm][:, perm], damp_percent).to(w.device)
    if group_size > 0:  # whole groups per block, see _quantize_columns
        block_size = group_size * max(1, block_size // group_size)
    levels = _quantize_columns(
        w[:, perm].contiguous(), hinv, table, bits, block_size, group_size, scale_dtype
    )
    inverse_perm = torch.argsort(perm)
    g_idx = None
    if not is_static and act_order:
        g_idx = torch.tensor(table.group_of_position, dtype=torch.int32, device=w.device)[inverse_perm]
    return QuantizedWeight(
        qweight=levels[:, inverse_perm].contiguous(),
        scales=table.scales,
        zeros=table.zeros,
        bits=bits,
        group_size=group_size,
        g_idx=g_idx,
    )
