"""Formats: param_specs match pack exactly, spec round trips, apply == reference, errors."""

import pytest
import torch

from llmc.errors import LlmcError, RecipeError
from llmc.quant.formats import DenseFormat, Fp8Format, IntWeightFormat, default_g_idx, make_format
from llmc.quant.fp8 import quantize_fp8_weight
from llmc.quant.reference import dequantize, dequantize_weight, reference_linear

INT_SETTINGS = [(bits, gs, sym) for bits in (3, 4, 8) for gs in (32, 64, 128, -1) for sym in (True, False)]


def assert_matches_specs(fmt, params: dict, in_features: int, out_features: int) -> None:
    specs = fmt.param_specs(in_features, out_features)
    assert sorted(params) == sorted(specs)
    for name, spec in specs.items():
        assert (tuple(params[name].shape), params[name].dtype) == (spec.shape, spec.dtype), name


@pytest.mark.parametrize("bits,group_size,symmetric", INT_SETTINGS)
def test_int_pack_matches_param_specs_and_dequantizes_exactly(
    make_qweight, bits, group_size, symmetric
) -> None:
    q = make_qweight(bits, group_size, symmetric, out_features=24, in_features=256)
    fmt = make_format(
        {"format": f"w{bits}a16", "group_size": group_size, "symmetric": symmetric}, torch.bfloat16
    )
    params = fmt.pack(q)
    assert_matches_specs(fmt, params, 256, 24)
    # float64 direct computation from the plain form, with the scales as stored (bf16)
    g = default_g_idx(256, group_size).long()
    zeros = q.zeros.double() if q.zeros is not None else torch.full(q.scales.shape, 2.0 ** (bits - 1))
    expected = (q.qweight.double() - zeros[:, g]) * q.scales.to(torch.bfloat16).double()[:, g]
    torch.testing.assert_close(dequantize(fmt, params, 256).double(), expected, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(fmt.dequantize(params, 256).double(), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bits", [3, 4, 8])
def test_int_act_order_g_idx_is_stored_and_used(make_qweight, bits) -> None:
    q = make_qweight(bits, 32, False, in_features=128, is_act_order=True)
    fmt = IntWeightFormat(torch.float32, bits=bits, group_size=32, symmetric=False, has_g_idx=True)
    params = fmt.pack(q)
    assert_matches_specs(fmt, params, 128, 24)
    torch.testing.assert_close(dequantize(fmt, params), dequantize_weight(q))
    torch.testing.assert_close(fmt.dequantize(params, 128), dequantize_weight(q))


@pytest.mark.parametrize("bits,group_size,symmetric", INT_SETTINGS[::3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int_apply_equals_reference_linear(make_qweight, bits, group_size, symmetric, dtype) -> None:
    q = make_qweight(bits, group_size, symmetric, out_features=40, in_features=128)
    fmt = IntWeightFormat(dtype, bits, group_size, symmetric)
    params = fmt.pack(q)
    x = torch.randn(3, 5, 128, dtype=dtype)
    bias = torch.randn(40, dtype=dtype)
    y = fmt.apply(x, params, bias)
    assert y.shape == (3, 5, 40) and y.dtype == dtype
    expected = reference_linear(fmt, x, params, bias).float()
    # bf16 rounds the dequantized weights and the output: compare relative to the output's scale
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert (y.float() - expected).abs().max() <= tolerance * expected.abs().max()


def test_per_channel_3bit_needs_in_features_because_words_are_padded(make_qweight) -> None:
    q = make_qweight(3, -1, True, in_features=96)  # 96 is not a multiple of 10 levels per word
    fmt = IntWeightFormat(torch.float32, bits=3, group_size=-1)
    params = fmt.pack(q)
    assert params["qweight"].shape == (24, 10)
    torch.testing.assert_close(dequantize(fmt, params, in_features=96), dequantize_weight(q))
    with pytest.raises(ValueError, match="in_features"):
        dequantize(fmt, params)


@pytest.mark.parametrize(
    "spec",
    [
        {"format": "dense"},
        {"format": "w4a16", "bits": 4, "group_size": 128, "symmetric": True, "has_g_idx": False},
        {"format": "w3a16", "bits": 3, "group_size": -1, "symmetric": False, "has_g_idx": True},
        {"format": "w8a16", "bits": 8, "group_size": 64, "symmetric": True, "has_g_idx": False},
        {"format": "w8a8-fp8", "is_per_channel": False, "is_static_input": True},
    ],
)
def test_spec_round_trips_through_make_format(spec) -> None:
    assert make_format(spec, torch.float16).spec() == spec


def test_int_format_defaults_and_bits_from_name() -> None:
    fmt = make_format({"format": "w3a16"}, torch.float16)
    assert (fmt.bits, fmt.group_size, fmt.symmetric, fmt.has_g_idx) == (3, 128, True, False)


@pytest.mark.parametrize(
    "make",
    [
        lambda: IntWeightFormat(torch.float16, bits=5),
        lambda: IntWeightFormat(torch.float16, bits=4, group_size=48),
        lambda: make_format({"format": "w4a16", "bits": 8}, torch.float16),
        lambda: make_format({"format": "w4a16", "groupsize": 128}, torch.float16),
        lambda: make_format({"format": "w8a8-fp8", "per_channel": True}, torch.float16),
        lambda: IntWeightFormat(torch.float16, bits=4, group_size=128).param_specs(200, 16),
    ],
)
def test_bad_format_settings_raise_recipe_errors(make) -> None:
    with pytest.raises(RecipeError):
        make()


def test_pack_refuses_weights_the_format_cannot_hold(make_qweight) -> None:
    w4 = IntWeightFormat(torch.float16, bits=4, group_size=32, symmetric=True)
    with pytest.raises(RecipeError, match="bits: 4"):
        w4.pack(make_qweight(8, 32, True))
    with pytest.raises(RecipeError, match="group_size"):
        w4.pack(make_qweight(4, 64, True))
    with pytest.raises(RecipeError, match="symmetric: false"):
        w4.pack(make_qweight(4, 32, False))
    with pytest.raises(RecipeError, match="has_g_idx"):
        w4.pack(make_qweight(4, 32, True, is_act_order=True))
    with pytest.raises(LlmcError):
        Fp8Format(torch.float16).pack(make_qweight(8, -1, True))


def test_asymmetric_format_accepts_symmetric_weight_with_explicit_zeros(make_qweight) -> None:
    q = make_qweight(4, 32, True)
    fmt = IntWeightFormat(torch.float32, bits=4, group_size=32, symmetric=False)
    torch.testing.assert_close(dequantize(fmt, fmt.pack(q)), dequantize_weight(q))


@pytest.mark.parametrize("is_per_channel", [True, False])
@pytest.mark.parametrize("is_static_input", [True, False])
def test_fp8_pack_matches_specs_and_apply_equals_reference(is_per_channel, is_static_input) -> None:
    weight = torch.randn(48, 64)
    input_scale = torch.tensor([0.02]) if is_static_input else None
    q = quantize_fp8_weight(weight, is_per_channel, input_scale)
    fmt = Fp8Format(torch.bfloat16, is_per_channel=is_per_channel, is_static_input=is_static_input)
    params = fmt.pack(q)
    assert_matches_specs(fmt, params, 64, 48)
    x = torch.randn(2, 7, 64, dtype=torch.bfloat16)
    bias = torch.randn(48, dtype=torch.bfloat16)
    y = fmt.apply(x, params, bias)
    torch.testing.assert_close(y, reference_linear(fmt, x, params, bias), rtol=1e-2, atol=1e-2)
    exact = x.float() @ weight.T + bias.float()
    assert (y.float() - exact).abs().mean() < 0.1 * exact.abs().mean()


def test_fp8_per_channel_format_expands_a_per_tensor_scale() -> None:
    q = quantize_fp8_weight(torch.randn(8, 32), is_per_channel=False)
    params = Fp8Format(torch.float32).pack(q)
    assert params["weight_scale"].shape == (8, 1)
    torch.testing.assert_close(dequantize(Fp8Format(torch.float32), params), dequantize_weight(q))


def test_fp8_static_format_needs_an_input_scale() -> None:
    with pytest.raises(RecipeError, match="input_scale"):
        Fp8Format(torch.float16, is_static_input=True).pack(quantize_fp8_weight(torch.randn(4, 16)))


def test_fp8_cpu_path_says_once_that_it_is_the_reference(caplog) -> None:
    fmt = Fp8Format(torch.float32)
    params = fmt.pack(quantize_fp8_weight(torch.randn(4, 16)))
    with caplog.at_level("WARNING", logger="llmc"):
        fmt.apply(torch.randn(2, 16), params, None)
        fmt.apply(torch.randn(2, 16), params, None)
    # cached per device type: at most one record, and none if an earlier test already said it
    assert len([r for r in caplog.records if "reference path" in r.getMessage()]) <= 1


def test_dense_format_is_unchanged() -> None:
    fmt = DenseFormat(torch.float32)
    w = torch.randn(6, 8)
    params = fmt.pack_dense(w)
    x = torch.randn(3, 8)
    torch.testing.assert_close(fmt.apply(x, params, None), reference_linear(fmt, x, params, None))
