"""On a CUDA GPU: the formats' device paths agree with the reference (run with -m gpu)."""

import functools

import pytest
import torch

from llmc.quant.awq import awq_search_clip, awq_search_scale
from llmc.quant.formats import Fp8Format, IntWeightFormat
from llmc.quant.fp8 import quantize_fp8_weight
from llmc.quant.gptq import HessianAccumulator, gptq_quantize
from llmc.quant.reference import dequantize_weight, reference_linear
from llmc.quant.rtn import fake_quantize, rtn_quantize

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("num_tokens", [1, 37, 256])
@pytest.mark.parametrize("is_per_channel", [True, False])
@pytest.mark.parametrize("is_static_input", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_scaled_mm_matches_reference(num_tokens, is_per_channel, is_static_input, dtype) -> None:
    weight = torch.randn(384, 256, device="cuda")
    input_scale = torch.tensor([4.0 / 448], device="cuda") if is_static_input else None
    fmt = Fp8Format(dtype, is_per_channel=is_per_channel, is_static_input=is_static_input)
    params = fmt.pack(quantize_fp8_weight(weight, is_per_channel, input_scale))
    x = torch.randn(num_tokens, 256, device="cuda", dtype=dtype)
    bias = torch.randn(384, device="cuda", dtype=dtype)
    y = fmt.apply(x, params, bias)
    expected = reference_linear(fmt, x, params, bias)
    assert y.dtype == dtype and y.shape == (num_tokens, 384)
    assert (y.float() - expected.float()).abs().max() <= 1e-2 * expected.float().abs().max()


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs FP8 tensor cores")
def test_fp8_format_runs_few_tokens_through_the_small_m_kernel(monkeypatch) -> None:
    """The model's FP8 linears (the format's apply) take the few-token kernel that kernels/fp8.py
    dispatches to, not always torch._scaled_mm."""
    from llmc.kernels import fp8_triton

    calls, real = [], fp8_triton.fp8_linear_small_m
    monkeypatch.setattr(fp8_triton, "fp8_linear_small_m", lambda x, *a, **k: calls.append(x.shape[0]) or real(x, *a, **k))
    fmt = Fp8Format(torch.bfloat16)
    params = fmt.pack(quantize_fp8_weight(torch.randn(512, 256, device="cuda"), True, None))
    for num_tokens in (1, 16, 256):
        fmt.apply(torch.randn(num_tokens, 256, device="cuda", dtype=torch.bfloat16), params, None)
    assert calls == [1, 16]


@pytest.mark.parametrize("bits,group_size,symmetric", [(4, 128, True), (3, 64, False), (8, -1, True)])
def test_int_format_runs_on_cuda(bits, group_size, symmetric) -> None:
    weight = torch.randn(96, 256, device="cuda")
    fmt = IntWeightFormat(torch.bfloat16, bits, group_size, symmetric)
    params = fmt.pack(rtn_quantize(weight, bits, group_size, symmetric))
    x = torch.randn(5, 256, device="cuda", dtype=torch.bfloat16)
    y = fmt.apply(x, params, None)
    expected = reference_linear(fmt, x, params, None)
    assert (y.float() - expected.float()).abs().max() <= 1e-2 * expected.float().abs().max()


@pytest.mark.parametrize("act_order,static_groups", [(False, True), (True, True), (True, False)])
def test_gptq_and_awq_run_on_cuda_tensors(act_order, static_groups) -> None:
    x = torch.randn(512, 16, device="cuda") @ torch.randn(16, 256, device="cuda")
    weight = torch.randn(64, 256, device="cuda")
    accumulator = HessianAccumulator(256, device="cuda")
    accumulator.add_batch(x)
    q = gptq_quantize(
        weight, accumulator.hessian, 4, 64, False, act_order=act_order, static_groups=static_groups
    )
    assert q.qweight.is_cuda
    rtn_error = (x @ (fake_quantize(weight, 4, 64, False) - weight).T).pow(2).mean()
    assert (x @ (dequantize_weight(q) - weight).T).pow(2).mean() < rtn_error
    quantize_fn = functools.partial(fake_quantize, bits=4, group_size=64, symmetric=False)
    result = awq_search_scale(x, [weight], quantize_fn, n_grid=5)
    assert result.scales.is_cuda and result.best_loss <= result.loss_at_alpha0
    assert awq_search_clip(x, weight, quantize_fn, 64, n_grid=5).is_cuda


@pytest.mark.parametrize("num_tokens", [1, 16, 300])
def test_an_identity_act_order_perm_is_dropped_and_the_kernel_agrees(num_tokens) -> None:
    """An act-order down projection the build put in group order (compiler/shard.order_down_groups) packs
    with the identity perm; the loaded Linear drops it and runs the W4A16 kernel on x as it is, agreeing
    with the float reference of the same levels."""
    from llmc.runtime.layers.linear import Linear

    k, n = 1024, 512
    fmt = IntWeightFormat(torch.bfloat16, 4, 128, True, has_g_idx=True, layout="gpu")
    q = rtn_quantize(torch.randn(n, k, device="cuda"), 4, 128, True)
    q.g_idx = torch.arange(k, dtype=torch.int32, device="cuda") // 128  # in order, as the build leaves down
    params = fmt.pack(q)
    linear = Linear(k, n, fmt, False, torch.bfloat16).to_empty(device="cuda")
    for name, tensor in params.items():
        getattr(linear, name).copy_(tensor)
    assert linear.drop_identity_perm() and "perm" not in linear.params()
    x = torch.randn(num_tokens, k, device="cuda", dtype=torch.bfloat16)
    expected = x.double() @ dequantize_weight(q).double().T
    y = linear(x)
    assert (y.double() - expected).abs().max() <= 1e-2 * expected.abs().max()
