"""Round-to-nearest: the compressed-tensors/GPTQ convention, error bounds, clipping, fixed params."""

import pytest
import torch

from llmc.errors import RecipeError
from llmc.quant.reference import dequantize_weight
from llmc.quant.rtn import compute_qparams, fake_quantize, rtn_quantize


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_symmetric_scale_is_absmax_over_half_the_level_range(bits) -> None:
    weight = torch.randn(16, 64)
    q = rtn_quantize(weight, bits, 32, symmetric=True)
    absmax = weight.abs().reshape(16, 2, 32).amax(-1)
    torch.testing.assert_close(q.scales, absmax / ((2**bits - 1) / 2))
    assert q.zeros is None
    assert q.qweight.min() >= 0 and q.qweight.max() < 2**bits


def test_symmetric_4bit_uses_the_full_signed_range_like_compressed_tensors() -> None:
    weight = torch.tensor([[-7.5, 7.5, 0.0, 3.5]])  # scale = 7.5 / 7.5 = 1
    q = rtn_quantize(weight, 4, -1, symmetric=True)
    # -7.5 rounds (half to even) to -8 → level 0; +7.5 → 8 clamps to 7 → level 15; 3.5 → 4 → level 12
    assert q.scales.item() == 1.0
    assert q.qweight.tolist() == [[0, 15, 8, 12]]


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("group_size", [32, -1])
def test_asymmetric_zero_is_exact_and_error_within_half_a_step(bits, group_size) -> None:
    weight = torch.randn(8, 64) + 0.3
    weight[:, 5] = 0.0
    q = rtn_quantize(weight, bits, group_size, symmetric=False)
    deq = dequantize_weight(q)
    assert torch.all(deq[:, 5] == 0)
    step = q.scales.repeat_interleave(64 // q.scales.shape[1], dim=1)
    assert torch.all((deq - weight).abs() <= step / 2 + 1e-6)


def test_compute_qparams_includes_zero_in_the_range() -> None:
    positive = torch.tensor([[1.0, 2.0, 3.0]])
    scales, zeros = compute_qparams(positive, 4, symmetric=False)
    torch.testing.assert_close(scales, torch.tensor([3.0 / 15]))
    assert zeros.tolist() == [0]


def test_all_zero_group_dequantizes_to_zero() -> None:
    q = rtn_quantize(torch.zeros(2, 32), 4, 32, symmetric=True)
    assert torch.all(dequantize_weight(q) == 0)


def test_clip_ratio_shrinks_the_range_per_group() -> None:
    weight = torch.randn(4, 64)
    clip = torch.tensor([[1.0, 0.5]]).expand(4, 2)
    q = rtn_quantize(weight, 4, 32, symmetric=True, clip_ratio=clip)
    reference = rtn_quantize(weight, 4, 32, symmetric=True)
    torch.testing.assert_close(q.scales, reference.scales * clip)


def test_fixed_scales_and_zeros_are_used_as_given() -> None:
    weight = torch.randn(4, 64)
    scales = torch.full((4, 2), 0.1)
    zeros = torch.full((4, 2), 3, dtype=torch.int32)
    q = rtn_quantize(weight, 4, 32, symmetric=False, scales=scales, zeros=zeros)
    assert torch.equal(q.scales, scales) and torch.equal(q.zeros, zeros)
    expected = torch.clamp(torch.round(weight / 0.1) + 3, 0, 15)
    assert torch.equal(q.qweight, expected.int())


def test_scale_dtype_rounds_scales_before_the_levels() -> None:
    weight = torch.randn(4, 64)
    q = rtn_quantize(weight, 4, 32, symmetric=True, scale_dtype=torch.bfloat16)
    assert torch.equal(q.scales, q.scales.to(torch.bfloat16).float())


@pytest.mark.parametrize("symmetric", [True, False])
def test_fake_quantize_equals_dequantized_rtn(symmetric) -> None:
    weight = torch.randn(8, 128)
    torch.testing.assert_close(
        fake_quantize(weight, 4, 64, symmetric), dequantize_weight(rtn_quantize(weight, 4, 64, symmetric))
    )


def test_unusable_settings_raise_recipe_errors() -> None:
    with pytest.raises(RecipeError, match="bits"):
        rtn_quantize(torch.randn(4, 64), 9, 32, True)
    with pytest.raises(RecipeError, match="does not divide"):
        rtn_quantize(torch.randn(4, 100), 4, 32, True)
