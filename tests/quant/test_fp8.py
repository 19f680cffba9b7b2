"""FP8 E4M3: weight and activation round-trip error bounds, static scales."""

import pytest
import torch

from llmc.quant.fp8 import (
    FP8_E4M3_MAX,
    AbsmaxObserver,
    input_scale_from_absmax,
    quantize_fp8_per_token,
    quantize_fp8_static,
    quantize_fp8_weight,
)
from llmc.quant.reference import dequantize_weight

# E4M3 has 3 mantissa bits: relative rounding error ≤ 2**-4 for normal values; below the smallest
# normal (2**-6) the absolute error is ≤ half the subnormal step, 2**-10, in units of the scale.
RELATIVE_BOUND = 2.0**-4
SUBNORMAL_BOUND = 2.0**-10


def assert_within_fp8_error(approx: torch.Tensor, exact: torch.Tensor, scale: torch.Tensor) -> None:
    bound = torch.maximum(exact.abs() * RELATIVE_BOUND, scale * SUBNORMAL_BOUND)
    assert torch.all((approx - exact).abs() <= bound * (1 + 1e-6))


@pytest.mark.parametrize("is_per_channel", [True, False])
def test_weight_round_trip_is_within_e4m3_rounding(is_per_channel) -> None:
    weight = torch.randn(32, 64) * torch.logspace(-3, 1, 32).unsqueeze(1)  # rows of very different size
    q = quantize_fp8_weight(weight, is_per_channel)
    assert q.qweight.dtype == torch.float8_e4m3fn
    assert q.scales.shape == ((32, 1) if is_per_channel else (1, 1))
    absmax = weight.abs().amax(dim=1, keepdim=True) if is_per_channel else weight.abs().max()
    torch.testing.assert_close(q.scales, (absmax / 448).expand_as(q.scales))
    assert_within_fp8_error(dequantize_weight(q), weight, q.scales)
    assert q.qweight.float().abs().max() == FP8_E4M3_MAX  # the absmax lands on the top value


def test_per_channel_is_more_accurate_than_per_tensor_on_uneven_rows() -> None:
    weight = torch.randn(32, 64) * torch.logspace(-3, 1, 32).unsqueeze(1)

    def error(is_per_channel):
        return (
            (dequantize_weight(quantize_fp8_weight(weight, is_per_channel)) - weight).abs() / weight.abs()
        ).mean()

    assert error(True) < error(False)


def test_per_token_activations_get_their_own_scale() -> None:
    x = torch.randn(2, 5, 64) * torch.logspace(-2, 2, 5).reshape(1, 5, 1)
    x_fp8, scale = quantize_fp8_per_token(x)
    assert x_fp8.shape == x.shape and scale.shape == (2, 5, 1) and scale.dtype == torch.float32
    torch.testing.assert_close(scale, x.abs().amax(-1, keepdim=True) / 448)
    assert_within_fp8_error(x_fp8.float() * scale, x, scale)


def test_static_activation_scale_saturates_instead_of_overflowing() -> None:
    observer = AbsmaxObserver()
    observer.add_batch(torch.tensor([[0.5, -2.0]]))
    observer.add_batch(torch.tensor([[1.0]]))
    input_scale = observer.input_scale()
    torch.testing.assert_close(input_scale, input_scale_from_absmax(2.0))
    x_fp8, scale = quantize_fp8_static(torch.tensor([1.0, -2.0, 100.0]), input_scale)
    assert torch.isfinite(x_fp8.float()).all()
    torch.testing.assert_close(x_fp8.float() * scale, torch.tensor([1.0, -2.0, 2.0]))


def test_zero_weights_and_tokens_stay_zero() -> None:
    q = quantize_fp8_weight(torch.zeros(3, 16))
    assert torch.all(dequantize_weight(q) == 0)
    x_fp8, scale = quantize_fp8_per_token(torch.zeros(2, 16))
    assert torch.all(x_fp8.float() * scale == 0)
