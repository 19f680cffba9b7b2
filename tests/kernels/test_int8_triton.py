"""The W8A8 int8 Triton kernels (kernels/int8_triton.py) against kernels/int8.py's torch path, bit for bit:
the per-token quantization (levels and scales) and the GEMM with its fused epilogue (rtol=0, atol=0).

On the CPU they run in Triton's interpreter at small shapes, every kernel, tile tail, dtype and bias;
its float32 → bfloat16 cast truncates (conftest), so there a bfloat16 output is held to the torch
result's float32 truncated to bfloat16 (the float32 output, exact, shows the rest). On the GPU (marked
gpu) Llama-3-8B's four GEMM shapes at M = 1, 16, 300, 4096 against the torch path on the same GPU, and
a few tokens against the CPU.
"""

import pytest
import torch

from llmc.kernels.int8 import MIN_SCALE, int8_matmul, int8_linear, quantize_int8_per_token, select_int8_kernel
from tests.kernels.conftest import sm90_compile_facts

HAS_CUDA = torch.cuda.is_available()
LLAMA3_8B = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # K x N: qkv, o, gate_up, down


def _rows(num_tokens: int, size: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random tokens of very different magnitudes, then the hard rows: ties at .5 levels (scale 1 and
    2**-3, where x / scale is exactly k + 0.5), a zero row, the largest and smallest magnitudes the
    dtype holds (float32: subnormal), and a row whose absmax is negative."""
    generator = torch.Generator().manual_seed(seed)
    big = {torch.float16: 6e4, torch.bfloat16: 1e30, torch.float32: 1e30}[dtype]
    small = {torch.float16: 1e-6, torch.bfloat16: 1e-30, torch.float32: 1e-40}[dtype]
    x = torch.randn(num_tokens, size, generator=generator) * torch.logspace(-3, 2, num_tokens).unsqueeze(1)
    ties = torch.arange(size, dtype=torch.float32) % 254 - 126.5  # -126.5 .. 126.5, every half level
    ties[0] = 127.0  # absmax 127: scale 1
    special = torch.stack([ties, ties * 2**-3, torch.zeros(size), x[0] * big / x[0].abs().max(),
                           x[0] * small / x[0].abs().max(), -ties.abs()])
    return torch.cat([x, special]).to(dtype)


def _assert_same_quantization(actual, expected) -> None:
    assert actual[0].dtype == torch.int8 and actual[1].dtype == torch.float32
    assert actual[0].shape == expected[0].shape and actual[1].shape == expected[1].shape
    assert torch.equal(actual[1].cpu(), expected[1]), "scales differ"
    assert torch.equal(actual[0].cpu(), expected[0]), "levels differ"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens,size,one_pass_max", [(1, 64, 16384), (3, 300, 16384), (2, 300, 128)])
def test_quantization_is_the_torch_quantization_bit_for_bit(dtype, num_tokens, size, one_pass_max) -> None:
    """One pass (a row in registers, a power-of-two tail) and two passes (rows longer than one_pass_max)."""
    from llmc.kernels.int8_triton import quantize_int8_per_token as triton_quantize

    x = _rows(num_tokens, size, dtype)
    expected = quantize_int8_per_token(x, triton=False)
    assert (expected[0][num_tokens].abs() == 126).any()  # the ties row rounds to even levels
    _assert_same_quantization(triton_quantize(x, MIN_SCALE, one_pass_max=one_pass_max), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("one_pass_max", [16384, 4])
def test_quantization_at_inexact_scales_next_to_ties(dtype, one_pass_max) -> None:
    """Rows [A, ±A/2, ...]: A / 2 over scale = A / 127 is 63.5 up to the scale's rounding, so the level is
    63 or 64 by the last bit of an IEEE quotient (x times the reciprocal of the scale gets 72 of these
    384 wrong, and the scale times the reciprocal of 127 18 of the scales)."""
    from llmc.kernels.int8_triton import quantize_int8_per_token as triton_quantize

    amax = torch.cat([(1 + torch.arange(128) / 128) * 2.0**e for e in (-8, 0, 5)]).to(dtype).float()
    x = torch.stack([amax, amax / 2, -amax / 2, amax / 4, amax / 3, -amax * 0.7, torch.zeros_like(amax)], 1)
    x = x.to(dtype)
    expected = quantize_int8_per_token(x, triton=False)
    assert {63, 64} <= set(expected[0][:, 1].tolist())
    _assert_same_quantization(triton_quantize(x, MIN_SCALE, one_pass_max=one_pass_max), expected)


def test_quantization_of_strided_and_three_dim_inputs() -> None:
    from llmc.kernels.int8_triton import quantize_int8_per_token as triton_quantize

    x = torch.randn(2, 3, 96, dtype=torch.float16)
    _assert_same_quantization(triton_quantize(x, MIN_SCALE), quantize_int8_per_token(x, triton=False))
    wide = torch.randn(4, 160, dtype=torch.float16)[:, :80]  # row stride 160
    _assert_same_quantization(triton_quantize(wide, MIN_SCALE), quantize_int8_per_token(wide, triton=False))


def _operands(m: int, k: int, n: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=generator) * torch.logspace(-2, 1, m).unsqueeze(1)
    x_int8, x_scale = quantize_int8_per_token(x, triton=False)
    weight = torch.randint(-128, 128, (n, k), generator=generator, dtype=torch.int8)
    weight[0] = -128  # the extreme products
    x_int8[0] = 127
    w_scale = torch.rand(n, 1, generator=generator) * 1e-3 + 1e-5
    bias = torch.randn(n, generator=generator)
    return x_int8, x_scale, weight, w_scale, bias


def _truncated_to_bf16(y: torch.Tensor) -> torch.Tensor:
    """float32 → bfloat16 rounding toward zero: what the interpreter's cast does."""
    return (y.float().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


SMALL = dict(kind="small_m", block_m=16, block_n=32, block_k=64, num_warps=4, num_stages=2)
LARGE = dict(kind="large_m", block_m=32, block_n=32, block_k=64, num_warps=4, num_stages=2, group_m=2)


@pytest.mark.parametrize("m,k,n,tiles", [
    (1, 256, 48, dict(SMALL)),  # one token, N tail
    (5, 200, 40, dict(SMALL)),  # K tail inside a step
    (5, 456, 40, dict(SMALL, split_k=3)),  # three K splits summed by the last to arrive, K tail
    (20, 320, 72, dict(SMALL, split_k=2)),  # two token tiles, split
    (40, 136, 56, dict(SMALL, block_m=32)),  # two 32-token tiles
    (3, 7, 24, dict(SMALL)),  # K shorter than one step and not a multiple of 16
    (70, 200, 100, dict(LARGE)),  # every tail, 3 x 4 tiles in groups of 2
    (33, 64, 32, dict(LARGE)),  # K exactly one step
])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias_dtype", [None, "out", torch.float32])
def test_gemm_is_the_torch_product_bit_for_bit(m, k, n, tiles, out_dtype, bias_dtype) -> None:
    from llmc.kernels.int8_triton import int8_gemm

    x_int8, x_scale, weight, w_scale, bias = _operands(m, k, n)
    bias = None if bias_dtype is None else bias.to(out_dtype if bias_dtype == "out" else bias_dtype)
    y = int8_gemm(x_int8, x_scale, weight, w_scale, bias, out_dtype, **tiles)
    assert y.shape == (m, n) and y.dtype == out_dtype
    if out_dtype == torch.bfloat16:  # the interpreter truncates: the float32 result truncated
        expected = _truncated_to_bf16(int8_matmul(x_int8, x_scale, weight, w_scale, bias, torch.float32,
                                                  triton=False))
    else:
        expected = int8_matmul(x_int8, x_scale, weight, w_scale, bias, out_dtype, triton=False)
    torch.testing.assert_close(y, expected, rtol=0, atol=0)


@pytest.mark.parametrize("m", [1, 16, 17, 40, 64, 65])
def test_gemm_at_the_selected_tiles(m) -> None:
    """The tiles select_int8_kernel picks (full-size blocks, splits) on a small shape."""
    from llmc.kernels.int8_triton import int8_gemm

    x_int8, x_scale, weight, w_scale, bias = _operands(m, 1056, 136, seed=m)
    tiles = select_int8_kernel(m, 1056, 136)
    y = int8_gemm(x_int8, x_scale, weight, w_scale, bias.half(), torch.float16, **tiles)
    torch.testing.assert_close(y, int8_matmul(x_int8, x_scale, weight, w_scale, bias.half(), torch.float16,
                                              triton=False), rtol=0, atol=0)


# session 38's sweep (results/session38/call6.log): 128 x 128 x 64 tiles, 8 warps, 4 stages won every shape from
# 1024 tokens on
LARGE_M_TILES_OF_THE_SWEEP = dict(kind="large_m", block_m=128, block_n=128, block_k=64, split_k=1, num_warps=8,
                                  num_stages=4)


def test_selection_table() -> None:
    for k, n in LLAMA3_8B:
        for m in (1, 16):
            tiles = select_int8_kernel(m, k, n)
            assert tiles["kind"] == "small_m" and tiles["block_m"] == 16
            steps = -(-k // tiles["block_k"])
            assert 1 <= tiles["split_k"] <= steps // 4
            assert tiles["split_k"] == 1 or -(-n // tiles["block_n"]) * tiles["split_k"] <= 132
        assert select_int8_kernel(300, k, n)["kind"] == "large_m"
        assert select_int8_kernel(4096, k, n) == LARGE_M_TILES_OF_THE_SWEEP
        wide = n >= 16384  # gate_up: the sweep's wide-output tiles at 64 and 256 tokens
        assert select_int8_kernel(64, k, n)["kind"] == ("large_m" if wide else "small_m")
        assert select_int8_kernel(256, k, n)["block_m"] == (256 if wide else 64)
    assert select_int8_kernel(32, 4096, 4096)["block_m"] == 32


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("k,n", LLAMA3_8B, ids=[f"{k}x{n}" for k, n in LLAMA3_8B])
@pytest.mark.parametrize("m", [1, 16, 300, 4096])
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_triton_path_is_the_torch_path(k, n, m, has_bias, dtype, monkeypatch) -> None:
    """On the GPU, at Llama-3-8B's shapes: the Triton quantization and GEMM (int8_linear's default on
    CUDA) against torch's ops and torch._int_mm on the same GPU (which the CPU's numbers equal:
    tests/quant/test_int8.py), bit for bit; at a few tokens against the CPU as well."""
    import llmc.kernels.int8 as int8

    torch.manual_seed(m + k + n)
    x = torch.randn(m, k, device="cuda", dtype=dtype) * torch.logspace(-2, 1, m, device="cuda").unsqueeze(1).to(dtype)
    weight = torch.randint(-128, 128, (n, k), device="cuda", dtype=torch.int8)
    w_scale = torch.rand(n, 1, device="cuda") * 1e-3 + 1e-5
    bias = torch.randn(n, device="cuda", dtype=dtype) if has_bias else None
    triton_q = quantize_int8_per_token(x)
    torch_q = quantize_int8_per_token(x, triton=False)
    _assert_same_quantization(triton_q, (torch_q[0].cpu(), torch_q[1].cpu()))
    expected = int8_linear(x, weight, w_scale, bias, triton=False)
    with monkeypatch.context() as patch:  # the Triton path must not reach torch._int_mm
        patch.setattr(int8, "int8_mm", lambda *a: pytest.fail("torch._int_mm on the Triton path"))
        y = int8_linear(x, weight, w_scale, bias)
    torch.cuda.synchronize()
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    if m <= 16:
        cpu = int8_linear(x.cpu(), weight.cpu(), w_scale.cpu(), None if bias is None else bias.cpu())
        torch.testing.assert_close(y.cpu(), cpu, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("m,k,n", [(1, 200, 40), (5, 456, 40), (300, 136, 100), (17, 7, 24)])
def test_cuda_tails_are_the_torch_path(m, k, n) -> None:
    """Sizes off every tile and off cuBLAS's multiples of 8 (the torch path's float64 product there)."""
    x_int8, x_scale, weight, w_scale, bias = _operands(m, k, n, seed=1)
    args = [t.cuda() for t in (x_int8, x_scale, weight, w_scale, bias.bfloat16())]
    y = int8_matmul(*args, torch.bfloat16)
    torch.testing.assert_close(y.cpu(), int8_matmul(x_int8, x_scale, weight, w_scale, bias.bfloat16(), torch.bfloat16,
                                                    triton=False), rtol=0, atol=0)


_COMPILE_SM90 = r"""
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llmc.kernels import fp8_triton as ft, int8_triton as it
from llmc.kernels.int8 import INT8_TILES, LARGE_M_TILES

ALIGNED = ("K", "N", "stride_xm", "stride_wn", "stride_om", "stride_x", "k_per_split")  # as launches specialize them


def compile_90(fn, signature, constants, warps, stages):
    names = list(fn.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items()
             if t.startswith("*") or n in ALIGNED}
    source = ASTSource(fn, {**signature, **{k: "constexpr" for k in constants}}, constants, attrs)
    try:
        return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "num_stages": stages, "enable_fp_fusion": False})
    except FileNotFoundError as exc:  # a triton without its bundled ptxas
        print("SKIP", exc)
        raise SystemExit(0)


facts = {}
k = compile_90(ft._quantize_per_token_kernel, {"x_ptr": "*bf16", "out_ptr": "*i8", "scale_ptr": "*fp32",
               "size": "i32", "stride_x": "i32", "min_scale": "fp32"},
               {"BLOCK": 4096, "ONE_PASS": True, "PDL": True, "QMAX": 127.0, "INT": True}, ft.one_pass_warps(4096), 3)
ptx = k.asm["ptx"]
facts["quantize"] = {"div_rn": ptx.count("div.rn.f32"), "div_other": len(re.findall(r"div\.(full|approx)", ptx)),
                     "rounder": ptx.count("0f4B400000"), "local": ".local" in ptx}
common = {"x_ptr": "*i8", "xs_ptr": "*fp32", "w_ptr": "*i8", "ws_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*bf16"}
for tiles in [t for _, t, w in INT8_TILES for t in (t, w) if t is not None] + [LARGE_M_TILES]:
    if tiles["kind"] == "small_m":
        fn = it._int8_small_m_kernel
        signature = {**common, "part_ptr": "*i32", "counter_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
                     "k_per_split": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_om": "i32"}
        constants = {"HAS_BIAS": True, "SPLITS": 2}
    else:
        fn = it._int8_large_m_kernel
        signature = {**common, "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32",
                     "stride_om": "i32"}
        constants = {"HAS_BIAS": True, "GROUP_M": 8}
    constants |= {"BLOCK_M": tiles["block_m"], "BLOCK_N": tiles["block_n"], "BLOCK_K": tiles["block_k"], "PDL": True}
    k = compile_90(fn, signature, constants, tiles["num_warps"], tiles["num_stages"])
    ptx = k.asm["ptx"]
    facts[repr(tiles)] = {"wgmma_s8": bool(re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.s32\.s8\.s8", ptx)),
                          "fma": ptx.count("fma.rn.f32"), "cp_async": ptx.count("cp.async"), "local": ".local" in ptx,
                          "shared": k.metadata.shared}
print(json.dumps(facts))
"""


def test_kernels_compile_for_sm90() -> None:
    """The quantization and every tile set of the table compiled for an H100/H200 on this CPU (the installed
    triton and its ptxas, in a process of its own: the tests here run the interpreter), with the pointers and
    sizes 16-aligned as launches at Llama's shapes specialize them: IEEE divisions only (no approximate
    one) and the rounding constant kept; int8 wgmma, the loads pipelined (cp.async), no fused multiply-add
    in the epilogue (enable_fp_fusion off: torch rounds the product before the bias add), no local memory,
    shared memory that fits."""
    facts = sm90_compile_facts(_COMPILE_SM90)
    quantize = facts.pop("quantize")
    assert quantize["div_rn"] > 0 and quantize["div_other"] == 0 and quantize["rounder"] > 0 and not quantize["local"]
    from llmc.kernels.int8 import INT8_TILES, LARGE_M_TILES

    every = {str(t) for _, t, w in INT8_TILES for t in (t, w) if t is not None} | {str(LARGE_M_TILES)}
    assert set(facts) == every
    for tiles, gemm in facts.items():
        assert gemm["wgmma_s8"] and gemm["fma"] == 0 and gemm["cp_async"] > 0 and not gemm["local"], tiles
        assert gemm["shared"] <= 227 * 1024, tiles
