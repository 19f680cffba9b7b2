"""AWQ: the scale search never loses to α=0 and wins on outlier channels; clip search; folding."""

import functools

import pytest
import torch

from llmc.quant.awq import (
    awq_search_clip,
    awq_search_scale,
    fold_scale_into_linear_out,
    fold_scale_into_norm,
    scale_linear_in,
)
from llmc.quant.reference import dequantize_weight
from llmc.quant.rtn import fake_quantize, rtn_quantize


def quantizer(bits: int = 3, group_size: int = 64, symmetric: bool = False):
    return functools.partial(fake_quantize, bits=bits, group_size=group_size, symmetric=symmetric)


def inputs_with_outliers(seed: int = 0, num_tokens: int = 512, in_features: int = 128) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, in_features, generator=generator)
    x[:, [3, 40, 77, 120]] *= 25  # a few salient input channels, as in real LLM activations
    return x


@pytest.mark.parametrize("seed", range(4))
def test_scale_search_is_never_worse_than_alpha_zero(seed) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 128, generator=generator)  # no outliers: α = 0 may well be best
    weights = [torch.randn(32, 128, generator=generator), torch.randn(16, 128, generator=generator)]
    result = awq_search_scale(x, weights, quantizer(4, 32, True), n_grid=8)
    assert result.best_loss <= result.loss_at_alpha0
    if result.best_alpha == 0:
        assert torch.all(result.scales == 1)


def test_scale_search_beats_alpha_zero_on_outlier_channels() -> None:
    x = inputs_with_outliers()
    weights = [torch.randn(48, 128) * 0.02, torch.randn(32, 128) * 0.02]
    result = awq_search_scale(x, weights, quantizer())
    assert result.best_alpha > 0
    assert result.best_loss < 0.8 * result.loss_at_alpha0
    assert result.scales.shape == (128,)
    assert result.scales[[3, 40, 77, 120]].min() > result.scales.median()  # salient channels get scaled up
    # the loss reported is the output MSE of Q(W·s)/s against the float outputs
    candidate = quantizer()(weights[0] * result.scales) / result.scales
    assert (x @ (candidate - weights[0]).T).pow(2).mean() < (
        x @ (quantizer()(weights[0]) - weights[0]).T
    ).pow(2).mean()


def test_scale_search_uses_a_caller_loss() -> None:
    x = inputs_with_outliers()
    weights = [torch.randn(16, 128)]
    calls = []

    def loss_fn(candidates):
        calls.append(candidates)
        return float((x @ (candidates[0] - weights[0]).T).abs().mean())

    result = awq_search_scale(x, weights, quantizer(), n_grid=5, loss_fn=loss_fn)
    assert len(calls) == 5 and calls[0][0].shape == (16, 128)
    assert result.best_loss <= result.loss_at_alpha0


def group_output_error(x: torch.Tensor, weight: torch.Tensor, q) -> torch.Tensor:
    diff = (dequantize_weight(q) - weight).reshape(weight.shape[0], 2, 64)  # [out, G, gs]
    return torch.einsum("ogk,tgk->ogt", diff, x.reshape(-1, 2, 64)).pow(2).mean(-1)  # [out, G]


@pytest.mark.parametrize("symmetric", [True, False])
def test_clip_search_never_increases_any_group_error(symmetric) -> None:
    x = inputs_with_outliers(num_tokens=256)
    weight = torch.randn(40, 128)
    weight[:, 9] *= 6  # a weight outlier: clipping it helps the rest of its group
    clip_ratio = awq_search_clip(
        x, weight, quantizer(3, 64, symmetric), 64, max_num_tokens=128, rows_per_chunk=16
    )
    assert clip_ratio.shape == (40, 2) and clip_ratio.max() <= 1 and clip_ratio.min() >= 0.5
    assert (clip_ratio < 1).any()
    x_used = x[torch.linspace(0, 255, 128).long()]
    clipped = group_output_error(
        x_used, weight, rtn_quantize(weight, 3, 64, symmetric, clip_ratio=clip_ratio)
    )
    plain = group_output_error(x_used, weight, rtn_quantize(weight, 3, 64, symmetric))
    assert torch.all(clipped <= plain * (1 + 1e-5))
    assert clipped.sum() < plain.sum()


def test_folding_a_scale_keeps_the_block_output() -> None:
    x = torch.randn(10, 32)
    norm_weight, scales = torch.rand(32) + 0.5, torch.rand(32) + 0.5
    weight = torch.randn(8, 32)
    folded_norm, _ = fold_scale_into_norm(norm_weight, scales)
    torch.testing.assert_close(
        (x * folded_norm) @ scale_linear_in(weight, scales).T, (x * norm_weight) @ weight.T
    )

    before, bias = torch.randn(32, 16), torch.randn(32)  # a linear producing the 32 inputs
    h = torch.randn(5, 16)
    folded_before, folded_bias = fold_scale_into_linear_out(before, scales, bias)
    torch.testing.assert_close(
        (h @ folded_before.T + folded_bias) @ scale_linear_in(weight, scales).T,
        (h @ before.T + bias) @ weight.T,
        rtol=1e-4,
        atol=1e-4,
    )
