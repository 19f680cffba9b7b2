"""W4A16: the gpu packing layout, the format carrying it, the Triton GEMM and its dispatch table."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from llmc.errors import RecipeError
from llmc.kernels.w4a16_gemm import (
    DEFAULT_W4A16_TABLE,
    W4A16Config,
    dequantize_w4a16,
    gpu_packed_shapes,
    heuristic_w4a16_config,
    heuristic_w4a16_entries,
    pack_w4a16_for_gpu,
    parse_w4a16_table,
    select_w4a16_config,
    unpack_w4a16_from_gpu,
    w4a16_linear,
    wgmma_supported,
)
from llmc.quant.formats import IntWeightFormat, QuantizedWeight, make_format, num_groups_of
from llmc.quant.reference import dequantize, reference_linear

# (K, N, group_size, symmetric): K not a multiple of the 128-column tile, N not of 8 or of BLOCK_N
SHAPES = [(320, 40, 32, False), (256, 72, 128, True), (192, 24, -1, False), (384, 40, 64, True)]


def random_weight(k, n, group_size, symmetric, seed=0, device="cpu") -> QuantizedWeight:
    gen = torch.Generator().manual_seed(seed)
    num_groups = num_groups_of(k, group_size)
    levels = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scales = torch.rand(n, num_groups, generator=gen) * 0.02 + 0.005
    zeros = None if symmetric else torch.randint(0, 16, (n, num_groups), generator=gen, dtype=torch.int32)
    q = QuantizedWeight(levels, scales, zeros, 4, group_size)
    q.qweight, q.scales = q.qweight.to(device), q.scales.to(device)
    q.zeros = q.zeros.to(device) if q.zeros is not None else None
    return q


def formats(dtype, group_size, symmetric):
    plain = IntWeightFormat(dtype, 4, group_size, symmetric)
    return plain, IntWeightFormat(dtype, 4, group_size, symmetric, layout="gpu")


@pytest.mark.parametrize("k,n,group_size,symmetric", SHAPES)
def test_pack_unpack_round_trip_and_shapes(k, n, group_size, symmetric) -> None:
    q = random_weight(k, n, group_size, symmetric)
    params = pack_w4a16_for_gpu(q.qweight, q.scales, q.zeros)
    shapes = gpu_packed_shapes(k, n, q.scales.shape[1], symmetric)
    assert {name: tuple(t.shape) for name, t in params.items()} == shapes
    levels, scales, unpacked_zeros = unpack_w4a16_from_gpu(params, k)
    assert torch.equal(levels, q.qweight) and torch.equal(scales, q.scales)
    assert (unpacked_zeros is None) == symmetric
    if not symmetric:
        assert torch.equal(unpacked_zeros, q.zeros)


def test_pack_layout_puts_column_k_at_its_nibble() -> None:
    levels = torch.zeros(3, 256, dtype=torch.int32)
    levels[1, 128 + 16 * 5 + 7] = 9  # tile 1, nibble 5, word row 7
    qweight = pack_w4a16_for_gpu(levels, torch.ones(3, 2), None)["qweight"]
    expected = torch.zeros(32, 3, dtype=torch.int32)
    expected[16 + 7, 1] = 9 << 20
    assert torch.equal(qweight, expected)


@pytest.mark.parametrize("k,n,group_size,symmetric", SHAPES)
def test_gpu_layout_format_matches_plain_layout(k, n, group_size, symmetric) -> None:
    q = random_weight(k, n, group_size, symmetric)
    plain, gpu = formats(torch.bfloat16, group_size, symmetric)
    plain_params, gpu_params = plain.pack(q), gpu.pack(q)
    specs = gpu.param_specs(k, n)
    assert sorted(gpu_params) == sorted(specs)
    for name, spec in specs.items():
        assert (tuple(gpu_params[name].shape), gpu_params[name].dtype) == (spec.shape, spec.dtype), name
    expected = dequantize(plain, plain_params, k)  # the oracle, from the plain layout
    torch.testing.assert_close(gpu.dequantize(gpu_params, k), expected, rtol=0, atol=0)
    x = torch.randn(2, 3, k, dtype=torch.bfloat16)
    bias = torch.randn(n, dtype=torch.bfloat16)
    torch.testing.assert_close(
        gpu.apply(x, gpu_params, bias), reference_linear(plain, x, plain_params, bias), rtol=2e-2, atol=2e-2
    )


def act_order_weight(k, n, group_size, symmetric, device="cpu"):
    """A random weight whose groups are act-order: column i in group g_idx[i], each group of
    group_size columns scattered over the input dimension (as GPTQ's desc_act leaves them)."""
    q = random_weight(k, n, group_size, symmetric, device=device)
    order = torch.randperm(k, generator=torch.Generator().manual_seed(k + n))
    q.g_idx = torch.empty(k, dtype=torch.int32)
    q.g_idx[order] = torch.arange(k, dtype=torch.int32) // group_size
    q.g_idx = q.g_idx.to(device)
    return q


@pytest.mark.parametrize("k,n,group_size,symmetric", [s for s in SHAPES if s[2] != -1])
def test_act_order_gpu_layout_matches_plain_layout(k, n, group_size, symmetric) -> None:
    """Act-order groups are permuted into place at pack time: the gpu layout's weight, and its product
    with x gathered by `perm` (what the CUDA path runs), equal the plain layout's with g_idx."""
    from llmc.quant.formats import _w4a16_kernel

    q = act_order_weight(k, n, group_size, symmetric)
    plain = IntWeightFormat(torch.float16, 4, group_size, symmetric, has_g_idx=True)
    gpu = IntWeightFormat(torch.float16, 4, group_size, symmetric, has_g_idx=True, layout="gpu")
    plain_params, gpu_params = plain.pack(q), gpu.pack(q)
    specs = gpu.param_specs(k, n)
    assert sorted(gpu_params) == sorted(specs) and "perm" in specs
    for name, spec in specs.items():
        assert (tuple(gpu_params[name].shape), gpu_params[name].dtype) == (spec.shape, spec.dtype), name
    expected = dequantize(plain, plain_params, k)  # the oracle, from the plain layout and its g_idx
    torch.testing.assert_close(gpu.dequantize(gpu_params, k), expected, rtol=0, atol=0)
    x = torch.randn(2, 3, k, dtype=torch.float16)
    torch.testing.assert_close(_w4a16_kernel(x, gpu_params, None, gpu).float(),
                               reference_linear(plain, x, plain_params, None).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("symmetric,group_size,act_order", [(True, 128, False), (False, 64, False), (False, 64, True)])
def test_interleaved_gate_up_gives_silu_mul_of_the_float64_halves(symmetric, group_size, act_order) -> None:
    """A gate_up in the gpu layout, rows interleaved on load (gate and up alternating in runs of 8, each
    run one word of zero points), through the format's SiLU · mul path: the same as SiLU(x Wg^T) · x Wu^T
    of the plain layout's weight in float64; the reordered rows are exactly the documented ones."""
    k, size = 384, 48
    q = act_order_weight(k, 2 * size, group_size, symmetric) if act_order else random_weight(k, 2 * size, group_size,
                                                                                          symmetric)
    plain = IntWeightFormat(torch.float32, 4, group_size, symmetric, has_g_idx=act_order)
    gpu = IntWeightFormat(torch.float32, 4, group_size, symmetric, has_g_idx=act_order, layout="gpu")
    weight = dequantize(plain, plain.pack(q), k).double()  # [2 size, K]: gate rows, then up rows
    params = gpu.interleave_gate_up(gpu.pack(q))
    rows = torch.cat([torch.stack([weight[8 * r: 8 * r + 8], weight[size + 8 * r: size + 8 * r + 8]])
                      for r in range(size // 8)]).flatten(0, 1)
    assert torch.equal(gpu.dequantize(params, k).double(), rows)
    x = torch.randn(3, k, dtype=torch.float64)
    expected = F.silu(x @ weight[:size].T) * (x @ weight[size:].T)
    torch.testing.assert_close(gpu.apply_silu_mul(x.float(), params, None).double(), expected, rtol=1e-5, atol=1e-5)
    # formats that keep gate and up apart: the plain layout, and rows that are no whole runs of 16
    assert plain.interleave_gate_up(plain.pack(q)) is None
    assert gpu.interleave_gate_up(gpu.pack(random_weight(k, 40, group_size, symmetric))) is None


def test_act_order_groups_of_unequal_sizes_are_refused() -> None:
    q = act_order_weight(256, 16, 128, True)
    q.g_idx[:3] = 1 - q.g_idx[:3]  # three columns change group: 128 ± 3 per group
    with pytest.raises(RecipeError, match="unequal sizes"):
        IntWeightFormat(torch.float16, 4, 128, True, has_g_idx=True, layout="gpu").pack(q)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("num_tokens", [1, 16, 300])
def test_act_order_gpu_layout_on_cuda_matches_float64(rel_err, num_tokens) -> None:
    """Real Llama shape, act-order groups: the W4A16 kernels (each M takes another kernel) on x
    gathered by perm, against the float64 dequantized weight."""
    k, n = 4096, 4096
    q = act_order_weight(k, n, 128, False, "cuda")
    gpu = IntWeightFormat(torch.bfloat16, 4, 128, False, has_g_idx=True, layout="gpu")
    params = gpu.pack(q)
    plain = IntWeightFormat(torch.bfloat16, 4, 128, False, has_g_idx=True)
    weight = dequantize(plain, plain.pack(q), k).double()
    x = torch.randn(num_tokens, k, device="cuda", dtype=torch.bfloat16)
    assert rel_err(gpu.apply(x, params, None), x.double() @ weight.T) < 1e-2


def test_gpu_layout_spec_round_trip_and_errors() -> None:
    spec = {"format": "w4a16", "bits": 4, "group_size": 128, "symmetric": False, "has_g_idx": False, "layout": "gpu"}
    assert make_format(spec, torch.float16).spec() == spec
    with pytest.raises(RecipeError, match="layout"):
        IntWeightFormat(torch.float16, 8, 128, True, layout="gpu")
    act_order = {**spec, "has_g_idx": True}
    assert make_format(act_order, torch.float16).spec() == act_order
    with pytest.raises(RecipeError, match="layout"):
        IntWeightFormat(torch.float16, 4, 128, True, layout="marlin")


def test_table_lookup_and_heuristic() -> None:
    fused = W4A16Config(block_m=16, block_n=64, split_k=4).to_dict()
    table = {"4096x6144": [(16, fused, 5.0), (64, W4A16Config(block_m=64).to_dict(), 9.0), (256, {"kind": "dequant"}, 40.0)]}
    assert select_w4a16_config(1, 4096, 6144, json.loads(json.dumps(table)), 132) == W4A16Config(**fused)
    assert select_w4a16_config(1, 4096, 6144, table, 132) == W4A16Config(**fused)
    assert select_w4a16_config(17, 4096, 6144, table, 132).block_m == 64
    assert select_w4a16_config(4096, 4096, 6144, table, 132).kind == "dequant"
    assert select_w4a16_config(1, 512, 512, table, 132) == heuristic_w4a16_config(1, 512, 512, 132)
    small = heuristic_w4a16_config(1, 4096, 4096, 132)
    assert small.kind == "rows" and small.k_tiles > 1 and small.split_k > 1
    assert heuristic_w4a16_config(16, 4096, 4096, 132).kind == "wgmma"  # a Hopper GPU, the plan's assumption
    assert heuristic_w4a16_config(16, 4096, 4096, 132, wgmma=False).kind == "swap"  # any other GPU
    assert heuristic_w4a16_config(64, 4096, 28672, 132).kind == "wgmma"
    many = heuristic_w4a16_config(256, 4096, 28672, 132)  # the warp-specialized kernel from 128 tokens
    assert (many.kind, many.block_m, many.block_n) == ("wgmma_ws", 256, 128)
    wide = heuristic_w4a16_config(16, 4096, 28672, 132)  # 224 tiles of 128 rows for 132 SMs: no split
    assert (wide.block_n, wide.split_k, wide.is_stacked) == (128, 1, True)
    # 16-token tiles: per tile, the scale on each tile's products, a 4-stage ring (narrow or wide)
    narrow = heuristic_w4a16_config(16, 4096, 4096, 132)
    assert (narrow.block_n, narrow.is_stacked, narrow.scale_acc, narrow.num_stages) == (64, True, True, 4)
    assert (wide.scale_acc, wide.num_stages) == (True, 4)
    assert heuristic_w4a16_config(32, 4096, 4096, 132).scale_acc  # to 32 tokens
    # 64 tokens (the H100 check of session 24, benchmarks/RESULTS.md): 64 rows, split until the tiles fill the
    # SMs; 128 rows where those alone do
    assert heuristic_w4a16_config(64, 4096, 4096, 132) == W4A16Config("wgmma", 64, 64, 4, 4, 4, True, scale_acc=True)
    assert heuristic_w4a16_config(64, 4096, 6144, 132) == W4A16Config("wgmma", 64, 64, 2, 4, 4, True, scale_acc=True)
    assert heuristic_w4a16_config(64, 4096, 28672, 132) == W4A16Config("wgmma", 64, 128, 1, 4, 4, True,
                                                                        scale_acc=True)
    assert heuristic_w4a16_config(1024, 4096, 4096, 132).kind == "dequant"  # 64 tiles cannot fill 132 SMs
    assert select_w4a16_config(1, 4096, 4096, None, 132).kind == "wgmma"  # the recorded H100 table
    assert select_w4a16_config(256, 4096, 28672, None, 132).kind == "wgmma_ws"
    # beyond 1024 tokens: the warp-specialized 256-token tile where its tiles fill the last wave to 85% and K
    # has 16 tiles (o at 4096 tokens: 512 tiles, 97%), else dequantize + cuBLAS (Llama-2-13B's down at 2048
    # tokens: 320 tiles, 81%; K of 1024)
    many_tokens = W4A16Config("wgmma_ws", 256, 128, 1, 4, 3, True)
    assert heuristic_w4a16_config(4096, 4096, 4096, 132) == many_tokens
    assert heuristic_w4a16_config(3000, 4096, 4096, 132) == many_tokens  # the bucket's top decides
    assert heuristic_w4a16_config(20000, 4096, 4096, 132) == many_tokens  # the last bucket's config beyond it
    assert heuristic_w4a16_config(2048, 13824, 5120, 132).kind == "dequant"
    assert heuristic_w4a16_config(4096, 13824, 5120, 132) == many_tokens
    assert heuristic_w4a16_config(4096, 1024, 8192, 132).kind == "dequant"
    assert heuristic_w4a16_config(4096, 4096, 4096, 132, wgmma=False).kind == "dequant"  # no wgmma: cuBLAS


@pytest.mark.parametrize("k,n,num_sms", [(4096, 4096, 132), (14336, 4096, 108), (384, 640, 132), (64, 64, 16)])
def test_heuristic_entries_give_the_heuristic_at_every_m(k, n, num_sms) -> None:
    table = {f"{k}x{n}": heuristic_w4a16_entries(k, n, num_sms)}
    for m in [*range(1, 5000), 8192, 20000]:
        assert select_w4a16_config(m, k, n, table, 0) == heuristic_w4a16_config(m, k, n, num_sms), m


def test_parse_table_sorts_entries_and_refuses_malformed_ones() -> None:
    table = json.loads(json.dumps({"64x64": [[64, {"kind": "dequant"}, None], [1, W4A16Config("gemv", 1).to_dict(), 2.5]]}))
    parsed = parse_w4a16_table(table)
    assert parsed["64x64"] == ((1, W4A16Config("gemv", 1), 2.5), (64, W4A16Config("dequant"), None))
    for bad in ({"64x64": []}, {"64x64": [[1, {"kind": "magic"}, None]]}, {"64x64": [[1, {"tile": 3}, None]]},
                {"64x64": [[1, {"kind": "dequant"}]]}):
        with pytest.raises((TypeError, ValueError)):
            parse_w4a16_table(bad)


# (kind, block_m, block_n, split_k, is_stacked, k_tiles): every kernel path, split and not, a partial
# N tile, a partial last load of K tiles
CONFIGS = [
    ("fused", 16, 32, 1, False, 1), ("fused", 16, 32, 2, True, 1), ("fused", 32, 16, 3, False, 1),
    ("gemv", 2, 32, 1, False, 1), ("gemv", 4, 16, 2, True, 1),
    ("swap", 16, 16, 1, False, 1), ("swap", 32, 32, 2, False, 1),
    ("rows", 1, 32, 1, False, 2), ("rows", 1, 16, 2, False, 4),
]


@pytest.mark.parametrize("m", [1, pytest.param(5, marks=pytest.mark.slow), 33])  # (1: one row; 33: past a tile)
@pytest.mark.parametrize("k,n,group_size,symmetric", SHAPES[:3])
def test_triton_gemm_matches_reference(dot_case, rel_err, m, k, n, group_size, symmetric) -> None:
    from llmc.kernels.w4a16_triton import launch_w4a16_gemm

    device, dtype = dot_case
    q = random_weight(k, n, group_size, symmetric, seed=m, device=device)
    plain, gpu = formats(dtype, group_size, symmetric)
    params = gpu.pack(q)
    x = torch.randn(m, k, device=device).to(dtype)
    bias = torch.randn(n, device=device).to(dtype)
    weight = dequantize(plain, plain.pack(q), k).double()  # [N, K] from the plain layout
    expected = x.double() @ weight.T + bias.double()
    for kind, block_m, block_n, split_k, is_stacked, k_tiles in CONFIGS:
        if kind in ("gemv", "rows") and m > 5:
            continue  # the interpreter is slow at many GEMV programs; the GPU cases cover them
        y = launch_w4a16_gemm(
            x, params["qweight"], params["scales"], params.get("qzeros"), bias, group_size,
            kind, block_m, block_n, split_k, 4, 2, is_stacked, k_tiles,
        )
        assert y.shape == (m, n) and y.dtype == dtype and torch.isfinite(y).all()
        assert rel_err(y, expected) < (1e-5 if dtype == torch.float32 else 5e-3), (kind, block_m, block_n, split_k)


@pytest.mark.parametrize("kind,block_m,block_n,split_k,m", [("swap", 16, 16, 3, 20), ("rows", 1, 16, 2, 3)])
def test_split_k_summed_in_the_kernel_as_by_the_second_pass(dot_case, monkeypatch, kind, block_m, block_n, split_k,
                                                            m) -> None:
    """The last split of each output tile sums the fp32 partials in the GEMM kernel itself: the same
    bits as the separate reduction kernel, and every tile's semaphore back at zero for the next call."""
    from llmc.kernels import split_k_triton
    from llmc.kernels.w4a16_triton import launch_w4a16_gemm

    device, dtype = dot_case
    k, n, group_size, symmetric = SHAPES[1]
    params = formats(dtype, group_size, symmetric)[1].pack(random_weight(k, n, group_size, symmetric, device=device))
    x = torch.randn(m, k, device=device).to(dtype)
    bias = torch.randn(n, device=device).to(dtype)
    run = lambda: launch_w4a16_gemm(x, params["qweight"], params["scales"], params.get("qzeros"), bias, group_size,
                                    kind, block_m, block_n, split_k, 4, 2)
    counters = torch.zeros(64, dtype=torch.int32, device=device)
    monkeypatch.setattr(split_k_triton, "tile_counters", lambda device, num_tiles: counters[:num_tiles])
    in_kernel = run()
    assert counters.eq(0).all()
    monkeypatch.setattr(split_k_triton, "tile_counters", lambda device, num_tiles: None)
    assert torch.equal(in_kernel, run())


@pytest.mark.parametrize("k,n,group_size,symmetric", SHAPES[::2])
def test_triton_dequantize_matches_reference(dot_case, k, n, group_size, symmetric) -> None:
    from llmc.kernels.w4a16_triton import launch_w4a16_dequantize

    device, dtype = dot_case
    q = random_weight(k, n, group_size, symmetric, device=device)
    params = formats(dtype, group_size, symmetric)[1].pack(q)
    weight = launch_w4a16_dequantize(params["qweight"], params["scales"], params.get("qzeros"), k, group_size)
    assert weight.shape == (n, k) and weight.dtype == dtype
    torch.testing.assert_close(weight.float(), dequantize_w4a16(params, k, group_size).to(dtype).float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 7, 16, 64, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_format_apply_on_cuda_dispatches_to_the_kernel(rel_err, m, dtype) -> None:
    k, n = 4096, 1000
    q = random_weight(k, n, 128, False, device="cuda")
    plain, gpu = formats(dtype, 128, False)
    params = gpu.pack(q)
    assert gpu.select_kernel(torch.zeros(1, device="cuda")) is not None
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    expected = reference_linear(plain, x, plain.pack(q), None)
    y = gpu.apply(x, params, None)
    assert y.dtype == dtype and rel_err(y, expected) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tune_returns_a_table_the_dispatch_reads(rel_err) -> None:
    from llmc.kernels.w4a16_tune import tune_w4a16

    table = tune_w4a16([(512, 256)], ms=(1,))
    assert [entry[0] for entry in table["512x256"]] == [1]
    q = random_weight(512, 256, 128, True, device="cuda")
    params = formats(torch.bfloat16, 128, True)[1].pack(q)
    x = torch.randn(3, 512, device="cuda", dtype=torch.bfloat16)
    y = w4a16_linear(x, params["qweight"], params["scales"], None, None, 128, table=table)
    expected = x.double() @ dequantize_w4a16(params, 512, 128).double().T
    assert rel_err(y, expected) < 1e-2


def test_wgmma_runs_only_where_the_gluon_kernel_can() -> None:
    """Kind "wgmma" (the Gluon kernel) needs sm_90, 16-bit activations, whole-tile groups and
    TMA-addressable rows; a table that names it elsewhere falls back in the dispatch."""
    assert wgmma_supported((9, 0), torch.bfloat16, 128, 4096, 4096)
    assert wgmma_supported((9, 0), torch.float16, -1, 4096, 1000)
    assert wgmma_supported((9, 0), torch.bfloat16, 256, 4096, 4096)
    assert not wgmma_supported((8, 0), torch.bfloat16, 128, 4096, 4096)  # Ampere: no wgmma
    assert not wgmma_supported((10, 0), torch.bfloat16, 128, 4096, 4096)  # Blackwell: no wgmma either
    assert not wgmma_supported((9, 0), torch.float32, 128, 4096, 4096)
    assert not wgmma_supported((9, 0), torch.bfloat16, 64, 4096, 4096)  # two groups per tile
    assert not wgmma_supported((9, 0), torch.bfloat16, 128, 4096, 1001)  # rows not 16-byte multiples
    config = W4A16Config("wgmma", 64, 128, 2, 8, 4, True)
    assert parse_w4a16_table({"64x64": [[1, config.to_dict(), 3.0]]})["64x64"][0][1] == config
    with pytest.raises(ValueError, match="set block_n to 128"):  # the warp-specialized tile has 128 rows
        parse_w4a16_table({"64x64": [[1, W4A16Config("wgmma_ws", 64, 256, 1, 4, 6, True).to_dict(), None]]})
    scaled = W4A16Config("wgmma", 16, 128, 8, 4, 4, True, scale_acc=True)
    assert parse_w4a16_table({"64x64": [[1, scaled.to_dict(), None]]})["64x64"][0][1] == scaled
    # the scale on the products exists only in the Gluon kernel's per-tile order
    for wrong in (dataclasses.replace(scaled, is_stacked=False), dataclasses.replace(scaled, kind="swap")):
        with pytest.raises(ValueError, match="scale_acc applies to kind wgmma with is_stacked only"):
            parse_w4a16_table({"64x64": [[1, wrong.to_dict(), None]]})
    # a table written before the field existed still reads (scale_acc off)
    old_entry = {k: v for k, v in W4A16Config("wgmma", 16, 64, 4, 4, 6, True).to_dict().items() if k != "scale_acc"}
    assert not parse_w4a16_table({"64x64": [[1, old_entry, None]]})["64x64"][0][1].scale_acc


def test_weight_descriptors_are_built_once_per_box_and_describe_the_table() -> None:
    """The Gluon launch keeps a weight table's TMA descriptors on the table: the same object on every
    launch with that box, another box another descriptor, and each addresses the table as TMA reads it
    (the packed words [K / 8, N] in 2-D boxes, scales and zero words flat)."""
    pytest.importorskip("triton.experimental.gluon")
    from triton.experimental.gluon import language as gl

    from llmc.kernels import w4a16_gluon

    qweight = torch.zeros(512, 768, dtype=torch.int32)
    scales = torch.zeros(32, 768, dtype=torch.bfloat16)
    words = w4a16_gluon._weight_descriptor(qweight, (16, 128), gl.int32)
    assert w4a16_gluon._weight_descriptor(qweight, (16, 128), gl.int32) is words
    assert (words.base.data_ptr(), list(words.shape), list(words.strides)) == (qweight.data_ptr(), [512, 768], [768, 1])
    assert list(words.block_shape) == [16, 128]
    wide = w4a16_gluon._weight_descriptor(qweight, (16, 64), gl.int32)
    assert wide is not words and list(wide.block_shape) == [16, 64]
    flat = w4a16_gluon._weight_descriptor(scales, (128,), gl.bfloat16)
    assert (flat.base.data_ptr(), list(flat.shape), list(flat.strides)) == (scales.data_ptr(), [32 * 768], [1])
    assert w4a16_gluon._weight_descriptor(torch.zeros_like(qweight), (16, 128), gl.int32) is not words


_COMPILE_SM90 = """
import os
import re
import subprocess
import sys
import tempfile
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from llmc.kernels import w4a16_gluon, w4a16_ws

order = sys.argv[1]  # "slice", "tile", "acc" (per tile, the scale on the products), "acc8" (the same on 8-token
# tiles and two warpgroups) or "ws" (warp-specialized)
# per slice and acc: the decode GEMV, whose splits the kernel sums (16-token tiles, as the dispatch runs it)
block_m, block_n, warps = {"slice": (16, 128, 4), "tile": (128, 64, 4), "acc": (16, 128, 4), "acc8": (8, 128, 8),
                           "ws": (256, 128, 4)}[order]
x_layout = gl.NVMMASharedLayout.get_default_for([block_m, w4a16_gluon.X_BOX_K], gl.bfloat16)
w_layout = gl.NVMMASharedLayout.get_default_for([16, block_n], gl.int32)
split = order in ("slice", "acc", "acc8")
signature = {
    "x_desc": f"tensordesc<bf16[{block_m}, {w4a16_gluon.X_BOX_K}],{x_layout!r}>",
    "w_desc": f"tensordesc<i32[16, {block_n}],{w_layout!r}>",
    "s_ptr": "*bf16", "qz_ptr": "*i32", "bias_ptr": "*bf16", "out_ptr": "*fp32" if split else "*bf16",
}
if order == "ws":  # the output by TMA stores: its descriptor in place of the pointer (boxes of the activations')
    signature["out_ptr"] = signature["x_desc"]
# the per-slice order compiled with split K and the in-kernel sum of the splits
constants = {"GROUP_SIZE": 128, "HAS_ZEROS": True, "HAS_BIAS": True, "IS_SPLIT": split, "STAGES": 4, "PDL": True,
             "num_warps": warps}
if order == "ws":
    constants |= {"STAGES": 3, "CONSUMER_REGS": 232, "TMA_STORE": True}
    kernel_fn = w4a16_ws._w4a16_ws_kernel
else:
    # acc8 finishes its tiles as SiLU(gate) · up (an interleaved gate_up)
    constants |= {"SUM_SPLITS": 4 if split else 0, "PER_TILE": order in ("tile", "acc", "acc8"),
                  "SCALE_ACC": order in ("acc", "acc8"), "SILU_MUL": order == "acc8",
                  "SILU_MUL_LATE_DEPENDENTS": True, "SCALE_RING": order in ("acc", "acc8"),
                  "ZERO_RING": order in ("acc", "acc8"),
                  "LIVE_OPERANDS": w4a16_gluon.live_operands(order != "slice", order in ("acc", "acc8"), warps)}
    kernel_fn = w4a16_gluon._w4a16_wgmma_kernel
s_layout = gl.NVMMASharedLayout.get_default_for([block_n], gl.bfloat16)  # the scale ring's boxes (acc, acc8)
z_layout = gl.NVMMASharedLayout.get_default_for([block_n // 8], gl.int32)  # and the zero words'
ring = constants.get("SCALE_RING", False)
signature |= {"final_ptr": "*bf16", "counter_ptr": "*i32",
              "s_desc": f"tensordesc<bf16[{block_n}],{s_layout!r}>" if ring else "*bf16",
              "z_desc": f"tensordesc<i32[{block_n // 8}],{z_layout!r}>" if ring else "*i32",
              **{name: "i32" for name in ("M", "N", "num_groups", "num_tiles", "tiles_per_split", "stride_om",
                                          "stride_split")},
              **{name: "constexpr" for name in constants}}
try:
    kernel = triton.compile(GluonASTSource(kernel_fn, signature, constants),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "launch_pdl": True})
except FileNotFoundError as exc:  # a triton without its bundled ptxas
    print("SKIP", exc)
    sys.exit(0)
ptx = kernel.asm["ptx"]
print("wgmma", "wgmma.mma_async.sync.aligned.m64n" in ptx)
print("tma", "cp.async.bulk.tensor.2d" in ptx)
print("paired", "sub.rn.bf16x2" in ptx and ("mul.rn.bf16x2" in ptx) != (order in ("acc", "acc8")))
print("local", ".local" in ptx)
print("counted", "atom.global.gpu.acq_rel.add" in ptx and "ld.global.cg" in ptx)
print("tma_store", "cp.async.bulk.tensor.2d.global.shared" in ptx)
print("shared", kernel.metadata.shared)
print("epilogue", "ex2", ptx.count("ex2.approx"), "st_shared", ptx.count("st.shared"))
print("warps", kernel.metadata.num_warps, "setmaxnreg", "setmaxnreg" in ptx)
before_wait = ptx.split("griddepcontrol.wait")
print("waits", len(before_wait) - 1, "launches_dependents", "griddepcontrol.launch_dependents" in before_wait[-1])
print("tma_before_wait", before_wait[0].count("cp.async.bulk.tensor"))
print("scale_loads", "tma", ptx.count("cp.async.bulk.tensor.1d"), "global", len(re.findall(r"ld\\.global[.\\w]*\\.b16", ptx)))
print("zero_loads", len(re.findall(r"ld\\.global(?!\\.cg)[.\\w]*\\.b32", ptx)))
print("launch_after_last_wgmma", ptx.rfind("griddepcontrol.launch_dependents") > ptx.rfind("wgmma.mma_async"))
# ptxas says so (C7513, C7515: the reason) when it serializes the wgmmas (waits for each before the next)
with tempfile.TemporaryDirectory() as tmp:
    with open(os.path.join(tmp, "k.ptx"), "w") as f:
        f.write(ptx)
    info = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", os.path.join(tmp, "k.ptx"), "-o",
                           os.path.join(tmp, "k.o")], capture_output=True, text=True)
    sass = subprocess.run([os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump"), "-sass",
                           os.path.join(tmp, "k.o")], capture_output=True, text=True).stdout
print("serialized", "instructions are serialized" in info.stdout + info.stderr, "ptxas_ok", info.returncode == 0)
# the paired subtracts of the conversion (HADD2, one per two weights) between a batch's last wgmma and the
# wait after it: the next tile's operands converted while the wgmmas run (the most over the kernel's batches)
opcodes = [m.group(1) for m in re.finditer(r"/\\*[0-9a-f]{4,}\\*/\\s+(?:@!?U?P\\w+\\s+)?([A-Z][\\w.]*)", sass)]
counts, since = [0], None
for opcode in opcodes:
    if opcode.startswith("HGMMA"):
        since = 0
    elif opcode.startswith("WARPGROUP.DEPBAR") and since is not None:
        counts.append(since)
        since = None
    elif since is not None and opcode.startswith("HADD2"):
        since += 1
print("before_wait", max(counts))
print("spills", "0 bytes spill stores" not in info.stdout + info.stderr)
"""


@pytest.mark.parametrize("order", [*(pytest.param(o, marks=pytest.mark.slow) for o in ("slice", "tile")),
                                   "acc", "acc8", "ws"])  # 2 s each: the default run compiles the orders the table runs
def test_wgmma_kernel_compiles_for_sm90_without_spills(order) -> None:
    """The Gluon kernels compiled for an H100 on this CPU (the installed triton and its ptxas), in a
    process of its own (the tests here run Triton's interpreter): wgmma, TMA loads, the paired bf16
    conversion, no local memory or spills, shared memory that fits; split K summed in the kernel (an
    acquire-release count per output tile, the partials read past L1); the scale-on-the-products
    order's group scales and zero words by TMA, none from global memory. ptxas keeps the per-tile
    order's wgmmas asynchronous, warp-specialized or not, and serializes the per-slice order's (the
    measured reason the per-tile order exists, benchmarks/RESULTS.md session 11). The
    warp-specialized kernel runs 4 + 4 + 1 warps (two consumer warpgroups, a producer warp; Triton
    rounds up to whole warpgroups) with their registers reassigned (setmaxnreg)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_SM90, order], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    if done.stdout.startswith("SKIP"):
        pytest.skip(done.stdout)
    facts = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert facts["wgmma"] == "True" and facts["tma"] == "True" and facts["paired"] == "True"
    assert facts["local"] == "False" and facts["spills"] == "False"
    assert facts["counted"] == str(order in ("slice", "acc", "acc8"))  # the semaphores, the partials read past L1
    assert facts["tma_store"] == str(order == "ws")  # the warp-specialized kernel's tiles leave by TMA stores
    assert int(facts["shared"]) <= 227 * 1024
    # programmatic dependent launch: one wait, then the next kernel may launch; the weight tiles of
    # the prologue (4 stages per tile, 3 per slice) are requested before the wait, the activations after
    # (triton 3.6 copies the wait into each branch of the unrolled prologue where no launch follows it)
    waits, launches = facts["waits"].split(" ", 1)
    assert (waits == "1" or order == "acc8") and launches == "launches_dependents True"
    if order != "ws":  # a SiLU · mul GEMV (acc8) lets the next kernel launch after its K loop, others at their start
        assert facts["launch_after_last_wgmma"] == str(order == "acc8")
    if order not in ("ws", "acc8"):  # (ws: the partitions' code is not in program order in the PTX text;
        # acc8: the wait is copied into the prologue's branches, after the first tile's load)
        # (acc: each tile's group scales and zero words come by TMA with its words, also before the wait)
        assert facts["tma_before_wait"] == {"slice": "3", "tile": "4", "acc": "12"}[order]
    if order in ("acc", "acc8"):  # the scale ring: the prologue's 4 tiles and the refill bring the scales and
        # the zero words (5 + 5 boxes); the 16-bit global loads left are the bias's (with the scales loaded
        # from global memory: 12 and 6), and no zero word comes by a global load (split partials aside)
        assert facts["scale_loads"] == ("tma 10 global 4" if order == "acc" else "tma 10 global 2")
        assert facts["zero_loads"] == "0"
    else:  # the other orders load their zero words from global memory
        assert int(facts["zero_loads"]) > 0
    assert facts["serialized"] == f"{order == 'slice'} ptxas_ok True"
    if order == "tile":  # LIVE_OPERANDS (the per-tile order with scaled operands on 4 warps): part of the next
        # tile's conversion (32 paired subtracts a thread) comes before the wait for this tile's wgmmas, in
        # registers of its own: 16 with triton 3.6, 14 with 3.9; without it ptxas reuses the operands' registers
        # and converts after the wait (0)
        assert int(facts["before_wait"]) >= 8, facts["before_wait"]
    if order == "acc8":  # SiLU · mul: one exp per gate element a thread holds (8 x 128 / 256 threads / 2), and
        # no shared memory beyond the split sum's one broadcast (gate and up meet in one thread)
        assert facts["epilogue"] == "ex2 2 st_shared 1"
    assert facts["warps"] == ("12 setmaxnreg True" if order == "ws" else
                              f"{8 if order == 'acc8' else 4} setmaxnreg False")


# (K, N, M, group, zero points, bias, dtype, config): M and N tails, K of a few tiles, split-K with an
# uneven last split, per-channel and 256-column groups, both conversion orders, every token tile
WGMMA_CASES = [
    (256, 128, 1, 128, False, False, torch.bfloat16, W4A16Config("wgmma", 16, 64, 1, 4, 2, False)),
    (512, 192, 5, 128, True, True, torch.bfloat16, W4A16Config("wgmma", 16, 128, 2, 8, 3, True)),
    (1024, 256, 70, -1, False, True, torch.float16, W4A16Config("wgmma", 64, 128, 1, 8, 4, False)),
    (384, 320, 300, 128, True, False, torch.bfloat16, W4A16Config("wgmma", 128, 128, 1, 8, 3, True)),
    (640, 256, 33, 128, False, False, torch.float16, W4A16Config("wgmma", 32, 64, 4, 4, 4, True)),
    (512, 128, 257, 256, False, True, torch.bfloat16, W4A16Config("wgmma", 256, 128, 1, 8, 2, False)),
    (4096, 4096, 256, 128, False, False, torch.bfloat16, W4A16Config("wgmma", 256, 128, 4, 8, 3, False)),
    (4096, 4096, 100, 128, True, True, torch.bfloat16, W4A16Config("wgmma", 128, 128, 2, 8, 4, True)),
    # per tile with the scale on each tile's products: zero points, bias, fp16, per-channel and 256-column
    # groups, N tails, split K with an uneven last split and a split of one tile, 8 warps, 32 tokens
    (512, 192, 5, 128, True, True, torch.bfloat16, W4A16Config("wgmma", 16, 128, 2, 4, 4, True, scale_acc=True)),
    (1024, 256, 16, -1, False, True, torch.float16, W4A16Config("wgmma", 16, 64, 1, 4, 4, True, scale_acc=True)),
    (768, 320, 1, 256, True, False, torch.bfloat16, W4A16Config("wgmma", 16, 128, 4, 8, 3, True, scale_acc=True)),
    (640, 256, 3, 128, False, False, torch.bfloat16, W4A16Config("wgmma", 16, 64, 8, 4, 4, True, scale_acc=True)),
    (384, 256, 33, 128, True, False, torch.float16, W4A16Config("wgmma", 32, 64, 1, 4, 4, True, scale_acc=True)),
    # 8-token tiles (the table to 8 tokens): one token, two token tiles (9), 8 warps, zero points, fp16, bias
    (512, 192, 1, 128, True, True, torch.bfloat16, W4A16Config("wgmma", 8, 64, 2, 4, 4, True, scale_acc=True)),
    (640, 320, 9, 128, False, False, torch.bfloat16, W4A16Config("wgmma", 8, 128, 1, 4, 4, True, scale_acc=True)),
    (1024, 256, 8, -1, True, True, torch.float16, W4A16Config("wgmma", 8, 128, 4, 8, 4, True, scale_acc=True)),
    # 64-token tiles with the scale on the products (the table and the heuristic at 33-64 tokens): an M tail,
    # split K, zero points, bias, fp16, per-channel groups, 128 rows
    (1024, 320, 50, 128, True, True, torch.bfloat16, W4A16Config("wgmma", 64, 64, 4, 4, 4, True, scale_acc=True)),
    (512, 256, 64, -1, False, False, torch.float16, W4A16Config("wgmma", 64, 128, 1, 4, 4, True, scale_acc=True)),
    # warp-specialized: a producer warp, two consumer warpgroups of 64 rows; M and N tails (N of 192: the
    # second warpgroup's rows partly past N), zero points, bias, fp16, per-channel and 256-column groups,
    # split K, fewer tiles than stages
    (512, 192, 70, 128, True, True, torch.bfloat16, W4A16Config("wgmma_ws", 64, 128, 1, 4, 6, True)),
    (1024, 256, 300, -1, False, True, torch.float16, W4A16Config("wgmma_ws", 128, 128, 2, 4, 5, True)),
    (512, 128, 257, 256, False, False, torch.bfloat16, W4A16Config("wgmma_ws", 256, 128, 1, 4, 3, True)),
    (4096, 6144, 256, 128, True, False, torch.bfloat16, W4A16Config("wgmma_ws", 128, 128, 1, 4, 5, True)),
    (14336, 4096, 1000, 128, False, True, torch.bfloat16, W4A16Config("wgmma_ws", 256, 128, 2, 4, 3, True)),
    # its TMA-store epilogue (unsplit): fp16 with bias, an N of 200 (the second tile's second warpgroup
    # partly past N) and an M tail; one K tile (the stage it stores through is the only one)
    (640, 200, 130, 128, True, True, torch.float16, W4A16Config("wgmma_ws", 128, 128, 1, 4, 5, True)),
    (128, 256, 64, 128, False, False, torch.bfloat16, W4A16Config("wgmma_ws", 64, 128, 1, 4, 6, True)),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("k,n,m,group,has_zeros,has_bias,dtype,config", WGMMA_CASES)
def test_wgmma_kernel_matches_float64(rel_err, k, n, m, group, has_zeros, has_bias, dtype, config) -> None:
    gen = torch.Generator().manual_seed(k + n + m)
    groups = 1 if group == -1 else k // group
    levels = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scales = (torch.rand(n, groups, generator=gen) * 0.01 + 0.001).to(dtype)
    zeros = torch.randint(0, 16, (n, groups), generator=gen, dtype=torch.int32) if has_zeros else None
    params = {name: t.cuda() for name, t in pack_w4a16_for_gpu(levels, scales, zeros).items()}
    x = torch.randn(m, k, generator=gen).to("cuda", dtype)
    bias = torch.randn(n, generator=gen).to("cuda", dtype) if has_bias else None
    table = {f"{k}x{n}": [(m, config, None)]}
    y = w4a16_linear(x, params["qweight"], params["scales"], params.get("qzeros"), bias, group, table=table)
    expected = x.double() @ dequantize_w4a16(params, k, group).double().T
    if bias is not None:
        expected += bias.double()
    assert y.dtype == dtype and y.shape == (m, n) and rel_err(y, expected) < 1e-2
    # the same operand as the dequantize + matmul path: the two agree to the output's rounding (with
    # scale_acc the weight is never rounded to 16 bits: they differ by that rounding as well)
    dense = F.linear(x.float(), dequantize_w4a16(params, k, group).to(dtype).float(),
                     None if bias is None else bias.float())
    assert rel_err(y, dense) < 4e-3


# (K, N, M, zero points, bias, dtype, config, semaphores): the table's gate_up entry at one token; split K
# summed in the kernel (bias, zero points) and by the second kernel (no semaphores, as in a graph capture
# that finds none); 8-token tiles of 8 warps over two token tiles (fp16); per tile with scaled operands;
# per slice; and kinds without the epilogue (warp-specialized, Triton's swap, dequantize + matmul)
SILU_MUL_CASES = [
    (4096, 28672, 1, False, False, torch.bfloat16, W4A16Config("wgmma", 16, 128, 1, 4, 4, True, scale_acc=True), True),
    (512, 384, 5, True, True, torch.bfloat16, W4A16Config("wgmma", 16, 128, 2, 4, 4, True, scale_acc=True), True),
    (512, 384, 5, True, True, torch.bfloat16, W4A16Config("wgmma", 16, 128, 2, 4, 4, True, scale_acc=True), False),
    (640, 256, 9, False, False, torch.float16, W4A16Config("wgmma", 8, 128, 1, 8, 4, True, scale_acc=True), True),
    (1024, 256, 16, False, True, torch.bfloat16, W4A16Config("wgmma", 16, 64, 4, 4, 4, True), True),
    (512, 192, 40, True, False, torch.bfloat16, W4A16Config("wgmma", 64, 64, 1, 4, 3, False), True),
    (384, 256, 300, False, False, torch.bfloat16, W4A16Config("wgmma_ws", 128, 128, 1, 4, 5, True), True),
    (256, 128, 3, True, False, torch.float16, W4A16Config("swap", 16, 64, 2, 4, 3), True),
    (256, 128, 70, False, True, torch.bfloat16, W4A16Config("dequant"), True),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU")
@pytest.mark.parametrize("k,n,m,has_zeros,has_bias,dtype,config,semaphores", SILU_MUL_CASES)
def test_silu_mul_in_the_gemv_epilogue_gives_the_bits_of_two_kernels(
        rel_err, monkeypatch, k, n, m, has_zeros, has_bias, dtype, config, semaphores) -> None:
    """An interleaved gate_up through w4a16_silu_mul: bit for bit SiLU · mul (the activation
    kernel) of the same GEMM's output, and SiLU(x Wg^T) · x Wu^T in float64 within the kernels' error."""
    from llmc.kernels import activation, split_k_triton
    from llmc.kernels.w4a16_gemm import interleave_gate_up, w4a16_silu_mul

    if not semaphores:
        monkeypatch.setattr(split_k_triton, "tile_counters", lambda device, num_tiles: None)
    gen = torch.Generator().manual_seed(k + n + m)
    levels = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    scales = (torch.rand(n, k // 128, generator=gen) * 0.004 + 0.001).to(dtype)
    zeros = torch.randint(0, 16, (n, k // 128), generator=gen, dtype=torch.int32) if has_zeros else None
    params = {name: t.cuda() for name, t in pack_w4a16_for_gpu(levels, scales, zeros).items()}
    weight = dequantize_w4a16(params, k, 128).double()  # gate rows, then up rows
    params = interleave_gate_up(params)
    bias = (0.1 * torch.randn(n, generator=gen)).to("cuda", dtype) if has_bias else None  # interleaved rows' bias
    rows = torch.arange(n)
    original_row = ((rows // 8) % 2) * (n // 2) + (rows // 16) * 8 + rows % 8  # of each interleaved row
    x = torch.randn(m, k, generator=gen).to("cuda", dtype)
    table = {f"{k}x{n}": [(m, config, None)]}
    args = (x, params["qweight"], params["scales"], params.get("qzeros"), bias, 128)
    fused = w4a16_silu_mul(*args, table=table)
    two_kernels = activation.silu_and_mul(w4a16_linear(*args, table=table), activation.GATE_UP_INTERLEAVE)
    assert fused.dtype == dtype and fused.shape == (m, n // 2)
    assert torch.equal(fused, two_kernels)
    gate_up = x.double() @ weight.T
    if bias is not None:
        gate_up[:, original_row.cuda()] += bias.double()
    assert rel_err(fused, F.silu(gate_up[:, : n // 2]) * gate_up[:, n // 2:]) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="needs a Hopper GPU (the table's Gluon kernels)")
def test_every_w4a16_table_entry_matches_float64_at_its_shape(rel_err) -> None:
    """Each (shape, M range) of DEFAULT_W4A16_TABLE, run through w4a16_linear (the dispatch the model
    uses) at the range's largest M and one M inside it, against float64 on the dequantized weight."""
    for shape, entries in DEFAULT_W4A16_TABLE.items():
        k, n = map(int, shape.split("x"))
        gen = torch.Generator().manual_seed(k + n)
        levels = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
        scales = (torch.rand(n, k // 128, generator=gen) * 0.004 + 0.001).to(torch.bfloat16)
        params = {name: t.cuda() for name, t in pack_w4a16_for_gpu(levels, scales, None).items()}
        w64 = dequantize_w4a16(params, k, 128).double()
        previous = 0
        for max_m, _, _ in entries:
            for m in (max_m, (previous + max_m + 1) // 2):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                y = w4a16_linear(x, params["qweight"], params["scales"], None, None, 128)
                assert rel_err(y, x.double() @ w64.T) < 1e-2, (shape, m)
            previous = max_m
