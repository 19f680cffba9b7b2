"""w8a8-int8 (llm-compressor's W8A8 int8 scheme): the format's product against a float64 reference written from
the published definitions (vLLM's dynamic per-token int8 activations, compressed-tensors' symmetric per-channel int8
weights), packing, and the SmoothQuant fold."""

import pytest
import torch

from llmc.compiler.convert import LayerWeights
from llmc.compiler.quantize import SMOOTHQUANT_MAPPINGS, quantize_rtn, smooth_layer, smoothing_scales
from llmc.errors import RecipeError
from llmc.kernels.int8 import int8_mm, quantize_int8_per_token
from llmc.quant.formats import Int8W8A8Format, make_format
from llmc.quant.reference import reference_linear


def published_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's dynamic per-token int8 (scaled_int8_quant, azp off), in float64 from float32 inputs: scale =
    absmax / 127 (float32), q = round-half-even(x / scale) saturated to [-128, 127] (never below -127 here)."""
    x32 = x.to(torch.float32)
    scale = x32.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.where(scale > 0, x32 / torch.where(scale > 0, scale, 1.0), 0.0)
    return torch.round(q).clamp(-128, 127).double(), scale.double()


def published_per_channel_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' symmetric int8 per output channel, in float32 as it computes for a float32 model:
    scale = absmax / ((127 - (-128)) / 2), q = clamp(round(w / scale), -128, 127)."""
    scale = w.float().abs().amax(dim=1, keepdim=True) / 127.5
    return torch.clamp(torch.round(w.float() / scale), -128, 127).double(), scale.double()


def _packed(weight: torch.Tensor) -> tuple[Int8W8A8Format, dict]:
    fmt = Int8W8A8Format(torch.float32)
    return fmt, fmt.pack(quantize_rtn(weight, fmt.spec(), torch.float32))


@pytest.mark.parametrize("shape", [(1, 64, 48), (5, 64, 40), (37, 200, 24), (3, 7, 64)])
def test_product_matches_a_float64_reference_of_the_published_definitions(shape) -> None:
    torch.manual_seed(0)
    m, k, n = shape
    x = torch.randn(m, k) * torch.logspace(-2, 1, m).unsqueeze(1)  # tokens of very different size
    x[0, 3] = 40.0  # an outlier channel
    weight = torch.randn(n, k) * torch.logspace(-2, 0, n).unsqueeze(1)
    bias = torch.randn(n)
    fmt, params = _packed(weight)
    x_q, x_scale = published_per_token_int8(x)
    w_q, w_scale = published_per_channel_int8(weight)
    assert torch.equal(params["weight"].double(), w_q)  # the stored weight is compressed-tensors' int8
    assert torch.equal(params["weight_scale"].double(), w_scale)
    expected = (x_q @ w_q.T) * x_scale * w_scale.T + bias.double()
    got = fmt.apply(x, params, bias)
    torch.testing.assert_close(got.double(), expected, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(reference_linear(fmt, x, params, bias).double(), expected, rtol=2e-6, atol=1e-6)


def test_per_token_quantization_rounds_half_to_even_and_keeps_zero_tokens_zero() -> None:
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -127.0], [0.0] * 6, [1e-30, -1e-30, 0, 0, 0, 0]])
    q, scale = quantize_int8_per_token(x)
    assert q.dtype == torch.int8 and scale.shape == (3, 1)
    assert q[0].tolist() == [127, 0, 2, 2, 0, -127]  # half to even, as CUDA's __float2int_rn
    assert q[1].tolist() == [0] * 6 and torch.isfinite(scale).all()
    assert q[2].tolist() == [127, -127, 0, 0, 0, 0]
    assert q.abs().max() <= 127


def test_three_dims_bfloat16_and_an_empty_batch() -> None:
    torch.manual_seed(1)
    fmt, params = _packed(torch.randn(16, 32))
    x = torch.randn(2, 3, 32, dtype=torch.bfloat16)
    y = fmt.apply(x, params, None)
    assert y.shape == (2, 3, 16) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y, reference_linear(fmt, x, params, None))
    assert fmt.apply(torch.randn(0, 32), params, None).shape == (0, 16)


def test_integer_product_is_exact_at_the_extremes() -> None:
    k = 4096  # 4096 * 127 * 128 > 2**24: float32 accumulation could not hold it exactly
    a = torch.full((3, k), 127, dtype=torch.int8)
    b = torch.full((2, k), -128, dtype=torch.int8)
    assert int8_mm(a, b).tolist() == [[-127 * 128 * k] * 2] * 3


def test_spec_round_trip_and_refusals() -> None:
    fmt = make_format({"format": "w8a8-int8"}, torch.bfloat16)
    assert isinstance(fmt, Int8W8A8Format) and fmt.spec() == {"format": "w8a8-int8"}
    assert {n: (s.shape, s.dtype) for n, s in fmt.param_specs(64, 32).items()} == {
        "weight": ((32, 64), torch.int8), "weight_scale": ((32, 1), torch.float32)}
    with pytest.raises(RecipeError, match="unknown w8a8-int8 field"):
        make_format({"format": "w8a8-int8", "is_static_input": True}, torch.float32)
    w4 = quantize_rtn(torch.randn(8, 64), {"format": "w4a16", "bits": 4, "group_size": 32, "symmetric": True},
                      torch.float32)
    with pytest.raises(RecipeError, match="cannot be packed into w8a8-int8"):
        fmt.pack(w4)


def test_smoothing_scales_are_llm_compressors() -> None:
    """s_j = range_j^a / (2 max|W_j|)^(1-a); a zero weight column takes range_j; floored at 1e-5."""
    weight = torch.tensor([[1.0, -4.0, 0.0], [0.5, 2.0, 0.0]])
    ranges = torch.tensor([8.0, 2.0, 3.0])
    s = smoothing_scales(ranges, weight, 0.8)
    expected = torch.tensor([8.0**0.8 / 2.0**0.2, 2.0**0.8 / 8.0**0.2, 3.0])
    torch.testing.assert_close(s, expected)
    assert smoothing_scales(torch.zeros(3), weight, 0.5).min() == 1e-5


def test_smoothquant_fold_computes_the_same_float_model() -> None:
    """float64: RMSNorm(x; w / s) @ (W s)^T = RMSNorm(x; w) @ W^T for qkv and gate_up."""
    torch.manual_seed(2)
    hidden = 16
    linears = {"attn.qkv": torch.randn(24, hidden, dtype=torch.float64), "attn.o": torch.randn(hidden, 8, dtype=torch.float64),
               "mlp.gate_up": torch.randn(40, hidden, dtype=torch.float64), "mlp.down": torch.randn(hidden, 20, dtype=torch.float64)}
    norms = {"input_norm": torch.rand(hidden, dtype=torch.float64) + 0.5,
             "post_attn_norm": torch.rand(hidden, dtype=torch.float64) + 0.5}
    layer = LayerWeights(0, dict(linears), {}, dict(norms))
    x = torch.randn(10, hidden, dtype=torch.float64) * torch.logspace(-1, 1, hidden, dtype=torch.float64)
    ranges = {name: (x.amax(0) - x.amin(0)).float() for name, _ in SMOOTHQUANT_MAPPINGS}
    scales = smooth_layer(layer, ranges, 0.8)

    def rms(v, w):
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    for name, norm in SMOOTHQUANT_MAPPINGS:
        assert not torch.allclose(scales[name].double(), torch.ones(hidden, dtype=torch.float64))
        torch.testing.assert_close(rms(x, layer.norms[norm]) @ layer.linears[name].T, rms(x, norms[norm]) @ linears[name].T,
                                   rtol=1e-12, atol=1e-12)
    assert torch.equal(layer.linears["attn.o"], linears["attn.o"]) and torch.equal(layer.linears["mlp.down"], linears["mlp.down"])


def test_smoothing_without_a_norm_is_refused_by_name() -> None:
    layer = LayerWeights(0, {"attn.qkv": torch.randn(4, 4), "mlp.gate_up": torch.randn(4, 4)}, {}, {})
    with pytest.raises(RecipeError, match="no input_norm before attn.qkv"):
        smooth_layer(layer, {"attn.qkv": torch.ones(4), "mlp.gate_up": torch.ones(4)}, 0.8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 5, 16, 17, 64, 300])
def test_cuda_product_is_the_cpu_product(m) -> None:
    """cuBLAS int8 GEMM (torch._int_mm, M padded past 16) gives the CPU's integers, and the same epilogue."""
    torch.manual_seed(3)
    fmt, params = _packed(torch.randn(256, 512))
    x = torch.randn(m, 512, dtype=torch.bfloat16)
    bias = torch.randn(256, dtype=torch.bfloat16)
    cpu = fmt.apply(x, params, bias)
    gpu = fmt.apply(x.cuda(), {k: v.cuda() for k, v in params.items()}, bias.cuda())
    x_q, _ = quantize_int8_per_token(x)
    assert torch.equal(quantize_int8_per_token(x.cuda())[0].cpu(), x_q)
    assert torch.equal(int8_mm(x_q.cuda(), params["weight"].cuda()).cpu(), int8_mm(x_q, params["weight"]))
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_product_with_sizes_cublas_does_not_take() -> None:
    """K or N not a multiple of 8: the exact float64 product on the GPU, the CPU's numbers."""
    torch.manual_seed(4)
    fmt, params = _packed(torch.randn(20, 36))
    x = torch.randn(33, 36)
    torch.testing.assert_close(fmt.apply(x.cuda(), {k: v.cuda() for k, v in params.items()}, None).cpu(),
                               fmt.apply(x, params, None), rtol=0, atol=0)
