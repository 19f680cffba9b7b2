"""GPTQ: beats RTN on correlated inputs, act-order groups, dead columns, damping retries, float targets."""

import logging

import pytest
import torch

from llmc.quant.formats import IntWeightFormat
from llmc.quant.gptq import CLIP_RATIOS, HessianAccumulator, float_target_weight, gptq_quantize
from llmc.quant.reference import dequantize, dequantize_weight
from llmc.quant.rtn import fake_quantize, rtn_quantize


def correlated_inputs(num_tokens: int = 1024, in_features: int = 128, seed: int = 0) -> torch.Tensor:
    """Low-rank inputs with a few loud channels: where compensating rounding errors pays off."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(num_tokens, 16, generator=generator)
    x = base @ torch.randn(16, in_features, generator=generator) + 0.1 * torch.randn(
        num_tokens, in_features, generator=generator
    )
    x[:, :4] *= 8
    return x


def output_error(x: torch.Tensor, weight: torch.Tensor, q) -> float:
    return (x @ (dequantize_weight(q) - weight).T).pow(2).mean().item()


def hessian_of(x: torch.Tensor) -> torch.Tensor:
    accumulator = HessianAccumulator(x.shape[1])
    for chunk in x.split(300):  # uneven batches
        accumulator.add_batch(chunk.unsqueeze(0))
    assert accumulator.num_samples == x.shape[0]
    return accumulator.hessian


def test_hessian_accumulator_is_2_xtx_over_n() -> None:
    x = correlated_inputs(num_tokens=1000)
    torch.testing.assert_close(hessian_of(x), 2 * x.T @ x / 1000, rtol=1e-4, atol=1e-3)


def drifted(x: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """x as the quantized model would see it: the float inputs plus an error that depends on them."""
    generator = torch.Generator().manual_seed(seed)
    return x @ (torch.eye(x.shape[1]) + 0.05 * torch.randn(x.shape[1], x.shape[1], generator=generator)) + 0.05 * torch.randn(
        x.shape, generator=generator)


def test_accumulated_drift_is_2_dxt_x_over_n() -> None:
    x_float = correlated_inputs(num_tokens=1000)
    x = drifted(x_float)
    accumulator = HessianAccumulator(x.shape[1], with_drift=True)
    for chunk, chunk_float in zip(x.split(300), x_float.split(300)):
        accumulator.add_batch(chunk, chunk_float)
    torch.testing.assert_close(accumulator.hessian, 2 * x.T @ x / 1000, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(accumulator.drift, 2 * (x_float - x).T @ x / 1000, rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError):
        accumulator.add_batch(x)  # an accumulator of drift needs the float inputs too


def test_float_target_weight_is_the_ridge_least_squares_fit_to_the_float_output() -> None:
    """Against lstsq in float64 on the stacked system: min (2/n)‖x̃ Ŵᵀ − x Wᵀ‖² + λ‖Ŵ − W‖²."""
    x_float = correlated_inputs(num_tokens=600, in_features=64)
    x = drifted(x_float).double()
    x_float = x_float.double()
    weight = torch.randn(16, 64, dtype=torch.float64)
    accumulator = HessianAccumulator(64, with_drift=True)
    accumulator.add_batch(x, x_float)
    damp_percent = 0.01
    w_star = float_target_weight(weight, accumulator.hessian, accumulator.drift, damp_percent)
    n = x.shape[0]
    lam = damp_percent * torch.diagonal(2 * x.T @ x / n).mean()
    a = torch.cat([(2 / n) ** 0.5 * x, lam.sqrt() * torch.eye(64, dtype=torch.float64)])  # [n + in, in]
    b = torch.cat([(2 / n) ** 0.5 * x_float @ weight.T, lam.sqrt() * weight.T])  # [n + in, out]
    expected = torch.linalg.lstsq(a, b).solution.T
    torch.testing.assert_close(w_star.double(), expected, rtol=1e-3, atol=1e-4)
    # No drift, no change.
    same = HessianAccumulator(64, with_drift=True)
    same.add_batch(x_float, x_float)
    torch.testing.assert_close(float_target_weight(weight, same.hessian, same.drift, damp_percent), weight.float())


@pytest.mark.parametrize("group_size", [32, -1])
def test_gptq_on_float_targets_is_closer_to_the_float_output(group_size) -> None:
    x_float = correlated_inputs()
    x = drifted(x_float)
    weight = torch.randn(64, 128)
    accumulator = HessianAccumulator(128, with_drift=True)
    accumulator.add_batch(x, x_float)
    target = x_float @ weight.T  # what the float model computes

    def error_to_float(w):
        q = gptq_quantize(w, accumulator.hessian, 4, group_size, True, act_order=True)
        return (x @ dequantize_weight(q).T - target).pow(2).mean().item()

    w_star = float_target_weight(weight, accumulator.hessian, accumulator.drift, 0.01)
    assert error_to_float(w_star) < 0.8 * error_to_float(weight)


@pytest.mark.parametrize(
    "bits,group_size,symmetric", [(4, 32, True), (4, -1, False), (3, 64, False), (8, 128, True)]
)
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_output_error_is_below_rtn(bits, group_size, symmetric, act_order) -> None:
    x = correlated_inputs()
    weight = torch.randn(64, 128)
    q = gptq_quantize(weight, hessian_of(x), bits, group_size, symmetric, act_order=act_order)
    rtn = rtn_quantize(weight, bits, group_size, symmetric)
    assert output_error(x, weight, q) < 0.5 * output_error(x, weight, rtn)
    assert q.g_idx is None  # static groups: group of column i is i // group_size
    assert q.qweight.min() >= 0 and q.qweight.max() < 2**bits


def test_static_act_order_groups_come_from_the_original_columns() -> None:
    x = correlated_inputs()
    weight = torch.randn(32, 128)
    hessian = hessian_of(x)
    q = gptq_quantize(weight, hessian, 4, 32, True, act_order=True)
    # Each group's range: the clip ratio whose H_ii-weighted rounding error of the ORIGINAL columns is least.
    h_diag = torch.diagonal(hessian).view(1, 4, 32)
    errors, scales = [], []
    for ratio in CLIP_RATIOS:
        fake = fake_quantize(weight, 4, 32, True, clip_ratio=ratio).view(32, 4, 32)
        errors.append(((weight.view(32, 4, 32) - fake).pow(2) * h_diag).sum(-1))  # [out, G]
        scales.append(rtn_quantize(weight, 4, 32, True, clip_ratio=ratio).scales)
    best = torch.stack(errors).argmin(dim=0)  # [out, G]
    expected_scales = torch.stack(scales).gather(0, best.unsqueeze(0))[0]
    torch.testing.assert_close(q.scales, expected_scales)
    assert (best > 0).any()  # some ranges are clipped: the search did something


def test_dynamic_act_order_returns_g_idx_that_packs_and_dequantizes() -> None:
    x = correlated_inputs()
    x[:, 100:104] *= 20  # loud columns late in the input: act-order moves them to the front
    weight = torch.randn(32, 128)
    q = gptq_quantize(weight, hessian_of(x), 4, 32, False, act_order=True, static_groups=False)
    assert q.g_idx is not None and q.g_idx.shape == (128,)
    assert set(q.g_idx[100:104].tolist()) == {0}
    assert torch.bincount(q.g_idx).tolist() == [32] * 4
    fmt = IntWeightFormat(torch.float32, bits=4, group_size=32, symmetric=False, has_g_idx=True)
    torch.testing.assert_close(dequantize(fmt, fmt.pack(q)), dequantize_weight(q))
    assert output_error(x, weight, q) < output_error(x, weight, rtn_quantize(weight, 4, 32, False))


def test_dead_columns_quantize_to_zero() -> None:
    x = correlated_inputs()
    x[:, [7, 90]] = 0
    q = gptq_quantize(torch.randn(16, 128), hessian_of(x), 4, 32, True)
    assert torch.all(dequantize_weight(q)[:, [7, 90]] == 0)


def test_indefinite_hessian_is_damped_more_with_a_warning(caplog) -> None:
    hessian = torch.eye(64)
    hessian[0, 1] = hessian[1, 0] = 2.0  # eigenvalue -1: no Cholesky at 1% damping
    with caplog.at_level(logging.WARNING, logger="llmc"):
        q = gptq_quantize(torch.randn(8, 64), hessian, 4, 32, True)
    assert any("not positive definite" in r.getMessage() for r in caplog.records)
    assert torch.isfinite(dequantize_weight(q)).all()
