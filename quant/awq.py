"""AWQ (Lin et al. 2023): activation-aware per-input-channel scaling, then clipping, before rounding.

For linears sharing one input X (q/k/v after the attention norm, gate/up after the MLP norm, ...):
1. `awq_search_scale` picks s = mean|X|^α (per input channel): W·diag(s) is quantized, and X/s is
   produced for free by folding 1/s into the op before (`fold_scale_into_norm`,
   `fold_scale_into_linear_out`). Salient input channels get finer effective steps.
2. The caller applies the scale (`scale_linear_in` on each weight, a fold on the op before) and
   runs `awq_search_clip` on the scaled weight with X/s, then quantizes with `rtn_quantize(...,
   clip_ratio=...)` (or GPTQ).

`quantize_fn` is a fake-quantizer: quantize_fn(weight [out, in], clip_ratio=None) -> dequantized
float32 [out, in], e.g. functools.partial(rtn.fake_quantize, bits=4, group_size=128, symmetric=False).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch
from torch import Tensor

from llmc.quant.formats import num_groups_of

QuantizeFn = Callable[..., Tensor]

_MIN_SCALE = 1e-4  # channels that were never active would otherwise get s = 0 and divide by zero


class ScaleSearchResult(NamedTuple):
    scales: Tensor  # [in] float32: multiply W's input columns, divide the op before
    best_alpha: float | None  # None: the identity scales won
    best_loss: float
    loss_at_alpha0: float  # identity scales: plain quantization, the baseline best_loss never exceeds


def _scales_for(x_mean: Tensor, alpha: float, w_mean: Tensor | None = None) -> Tensor:
    """s = mean|x|^α (÷ mean|ŵ|^(1-α) with duo scaling), normalized around 1 (s / sqrt(max·min)) so
    neither W·s nor X/s over- or underflows."""
    s = x_mean.pow(alpha)
    if w_mean is not None:
        s = s / (w_mean.pow(1 - alpha) + 1e-4)
    s = s.clamp(min=_MIN_SCALE)  # [in]
    return s / (s.max() * s.min()).sqrt()


def weight_magnitude(weights: Sequence[Tensor], group_size: int) -> Tensor:
    """Mean over output rows of |w| relative to its group's max: [in]. The weight side of duo scaling."""
    w = torch.cat([w.float() for w in weights]).abs()  # [sum_out, in]
    size = w.shape[1] if group_size == -1 else group_size
    groups = w.view(w.shape[0], -1, size)
    groups = groups / groups.amax(dim=-1, keepdim=True).clamp(min=_MIN_SCALE)
    return groups.view(w.shape[0], -1).mean(dim=0)


def _output_mse(x: Tensor, weights: Sequence[Tensor], candidates: Sequence[Tensor], chunk_size: int) -> float:
    """Mean of (x Ŵᵀ - x Wᵀ)² over all tokens and concatenated outputs, in token chunks to bound memory."""
    diff = torch.cat(
        [c.float() - w.float() for c, w in zip(candidates, weights, strict=True)]
    )  # [sum_out, in]
    total = 0.0
    for chunk in x.split(chunk_size):
        total += (chunk.float() @ diff.T).pow(2).sum().item()  # [tokens, sum_out] → scalar
    return total / (x.shape[0] * diff.shape[0])


def awq_search_scale(
    x: Tensor,
    weights: Sequence[Tensor],
    quantize_fn: QuantizeFn,
    n_grid: int = 20,
    loss_fn: Callable[[list[Tensor]], float] | None = None,
    chunk_size: int = 4096,
    w_mean: Tensor | None = None,
) -> ScaleSearchResult:
    """Grid-search α ∈ linspace(0, 1, n_grid) for s = mean|x|^α shared by `weights` [out_i, in]
    (with `w_mean` from `weight_magnitude`, duo scaling: s = mean|x|^α / mean|ŵ|^(1-α)).

    x [num_tokens, in]. The loss is the output MSE (or `loss_fn(candidates)`, candidates being the
    dequantized Q(W·s)/s, e.g. a block-output loss). α = 0 (s = 1) is scored first and only a
    strictly lower loss replaces it, so the result is never worse than plain quantization.
    """
    x_mean = x.abs().float().mean(dim=0)  # [in]
    best: ScaleSearchResult | None = None
    alphas = torch.linspace(0, 1, n_grid).tolist()
    if w_mean is not None:  # duo scaling's α = 0 is not the identity: score the identity first
        alphas = [None, *alphas]
    for alpha in alphas:
        s = torch.ones_like(x_mean) if alpha is None else _scales_for(x_mean, alpha, w_mean)  # [in]
        candidates = [quantize_fn(w.float() * s) / s for w in weights]  # each [out_i, in]
        loss = loss_fn(candidates) if loss_fn is not None else _output_mse(x, weights, candidates, chunk_size)
        if best is None:
            best = ScaleSearchResult(s, alpha, loss, loss)
        elif loss < best.best_loss:
            best = ScaleSearchResult(s, alpha, loss, best.loss_at_alpha0)
    return best


def _subsample_tokens(x: Tensor, max_num_tokens: int) -> Tensor:
    """Evenly spaced rows (deterministic): clipping needs the input distribution, not every token."""
    if x.shape[0] <= max_num_tokens:
        return x
    index = torch.linspace(0, x.shape[0] - 1, max_num_tokens, device=x.device).long()
    return x[index]


def awq_search_clip(
    x: Tensor,
    weight: Tensor,
    quantize_fn: QuantizeFn,
    group_size: int,
    n_grid: int = 20,
    min_ratio: float = 0.5,
    max_num_tokens: int = 512,
    rows_per_chunk: int = 64,
) -> Tensor:
    """Per-group max-clipping ratio in linspace(1, min_ratio, n_grid) minimizing each group's output error.

    x [num_tokens, in] (already divided by the AWQ scales), weight [out, in] (already multiplied).
    Returns clip_ratio [out, num_groups] for `rtn_quantize(..., clip_ratio=...)`; 1.0 (no clipping)
    is scored first and kept on ties. Memory stays at rows_per_chunk × num_groups × max_num_tokens.
    """
    num_out, num_in = weight.shape
    num_groups = num_groups_of(num_in, group_size)
    x_groups = (
        _subsample_tokens(x, max_num_tokens).float().reshape(-1, num_groups, num_in // num_groups)
    )  # [t, G, gs]
    ratios = torch.linspace(1.0, min_ratio, n_grid).tolist()
    clip_ratio = torch.ones(num_out, num_groups, device=weight.device)
    for start in range(0, num_out, rows_per_chunk):
        rows = weight[start : start + rows_per_chunk].float()  # [c, in]
        best_error = torch.full((rows.shape[0], num_groups), float("inf"), device=weight.device)
        for ratio in ratios:
            diff = (quantize_fn(rows, clip_ratio=ratio) - rows).reshape(
                rows.shape[0], num_groups, -1
            )  # [c, G, gs]
            error = torch.einsum("cgk,tgk->cgt", diff, x_groups).pow(2).mean(dim=-1)  # [c, G]
            is_better = error < best_error
            best_error = torch.where(is_better, error, best_error)
            clip_ratio[start : start + rows.shape[0]][is_better] = ratio
    return clip_ratio


def scale_linear_in(weight: Tensor, scales: Tensor) -> Tensor:
    """W·diag(s): weight [out, in] with input column i multiplied by scales[i]."""
    return weight * scales.to(weight.dtype).unsqueeze(0)


def fold_scale_into_norm(
    norm_weight: Tensor, scales: Tensor, norm_bias: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """Divide a norm's affine weight (and bias) [in] by s, so the norm emits X/s."""
    s = scales.to(norm_weight.dtype)
    return norm_weight / s, None if norm_bias is None else norm_bias / s


def fold_scale_into_linear_out(
    weight: Tensor, scales: Tensor, bias: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """Divide a preceding linear's output rows (weight [out, in], bias [out]) by s [out], so it emits X/s."""
    s = scales.to(weight.dtype)
    return weight / s.unsqueeze(1), None if bias is None else bias / s
