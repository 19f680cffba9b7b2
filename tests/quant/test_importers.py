"""Importers: published layouts unpack and re-pack bit-exactly; hand-built words; fusion."""

import pytest
import torch

from llmc.errors import CheckpointError
from llmc.quant.fp8 import quantize_fp8_weight
from llmc.quant.import_config import ImportSpec
from llmc.quant.importers import (
    concat_out,
    pack_awq_gemm,
    pack_float_quantized,
    pack_gptq,
    pack_pack_quantized,
    unpack_awq_gemm,
    unpack_float_quantized,
    unpack_gptq,
    unpack_module,
    unpack_pack_quantized,
)
from llmc.quant.reference import dequantize_weight


def as_int32(value: int) -> int:
    return value - 2**32 if value >= 2**31 else value


def assert_same_weight(a, b) -> None:
    assert (a.bits, a.group_size) == (b.bits, b.group_size)
    assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales)
    for x, y in ((a.zeros, b.zeros), (a.g_idx, b.g_idx), (a.input_scale, b.input_scale)):
        assert (x is None and y is None) or torch.equal(x, y)


def assert_same_tensors(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def fp16_scales(q):
    q.scales = q.scales.half().float()  # published scales are fp16/bf16: make the round trip exact
    return q


# --- AutoAWQ GEMM ---


@pytest.mark.parametrize("group_size", [32, 128, -1])
def test_awq_round_trips_both_ways(make_qweight, group_size) -> None:
    q = fp16_scales(make_qweight(4, group_size, False, out_features=48, in_features=128))
    tensors = pack_awq_gemm(q)
    assert tensors["qweight"].shape == (128, 6) and tensors["scales"].dtype == torch.float16
    assert_same_weight(unpack_awq_gemm(tensors, group_size), q)
    published = {
        "qweight": torch.randint(-(2**31), 2**31 - 1, (128, 6), dtype=torch.int32),
        "qzeros": torch.randint(-(2**31), 2**31 - 1, (4, 6), dtype=torch.int32),
        "scales": torch.rand(4, 48, dtype=torch.float16),
    }
    assert_same_tensors(pack_awq_gemm(unpack_awq_gemm(published, 32)), published)


def test_awq_hand_built_word_has_outputs_in_nibble_order_0_2_4_6_1_3_5_7() -> None:
    tensors = {
        "qweight": torch.tensor([[0x75316420]], dtype=torch.int32),  # input 0: output o has level o
        "qzeros": torch.tensor([[0x33333333]], dtype=torch.int32),
        "scales": torch.full((1, 8), 0.5, dtype=torch.float16),
    }
    q = unpack_awq_gemm(tensors, -1)
    assert q.qweight.flatten().tolist() == list(range(8))
    assert dequantize_weight(q).flatten().tolist() == [(o - 3) * 0.5 for o in range(8)]


# --- GPTQ ---


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("is_v1", [True, False])
def test_gptq_round_trips_both_ways(make_qweight, bits, symmetric, is_v1) -> None:
    q = fp16_scales(make_qweight(bits, 32, symmetric, out_features=32, in_features=128, is_act_order=True))
    if not symmetric:
        q.zeros[0, 0] = 0  # v1 stores zero - 1: a zero of 0 wraps to the top level
    tensors = pack_gptq(q, is_v1=is_v1)
    assert tensors["qweight"].shape == (128 * bits // 32, 32) and tensors["qzeros"].shape == (
        4,
        32 * bits // 32,
    )
    assert_same_weight(unpack_gptq(tensors, bits, 32, is_v1=is_v1), q)
    assert_same_tensors(pack_gptq(unpack_gptq(tensors, bits, 32, is_v1), is_v1=is_v1), tensors)


def test_gptq_hand_built_4bit_symmetric_v1_and_v2() -> None:
    # output 0 has input levels 1..8 along the input dim; symmetric zero 8 is stored as 7 in v1
    qweight = torch.zeros(1, 8, dtype=torch.int32)
    qweight[0, 0] = as_int32(0x87654321)
    scales = torch.ones(1, 8, dtype=torch.float16)
    g_idx = torch.zeros(8, dtype=torch.int32)
    v1 = {
        "qweight": qweight,
        "qzeros": torch.tensor([[0x77777777]], dtype=torch.int32),
        "scales": scales,
        "g_idx": g_idx,
    }
    v2 = {**v1, "qzeros": torch.tensor([[as_int32(0x88888888)]], dtype=torch.int32)}
    for tensors, is_v1 in ((v1, True), (v2, False)):
        q = unpack_gptq(tensors, 4, -1, is_v1=is_v1)
        assert q.zeros is None and q.g_idx is None
        assert q.qweight[0].tolist() == list(range(1, 9))
        assert dequantize_weight(q)[0].tolist() == [float(v - 8) for v in range(1, 9)]
        assert_same_tensors(pack_gptq(q, is_v1=is_v1), tensors)


# --- compressed-tensors ---


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize(
    "group_size,symmetric,is_act_order",
    [(128, True, False), (32, False, False), (-1, False, False), (32, True, True)],
)
def test_pack_quantized_round_trips_both_ways(
    make_qweight, bits, group_size, symmetric, is_act_order
) -> None:
    q = make_qweight(bits, group_size, symmetric, out_features=20, in_features=256, is_act_order=is_act_order)
    q.scales = q.scales.bfloat16().float()
    tensors = pack_pack_quantized(q)
    if not symmetric:  # zero points are packed along the OUTPUT dim
        assert tensors["weight_zero_point"].shape == (-(-20 // (32 // bits)), q.scales.shape[1])
    assert_same_weight(unpack_pack_quantized(tensors, bits, group_size), q)
    assert_same_tensors(pack_pack_quantized(unpack_pack_quantized(tensors, bits, group_size)), tensors)


def test_pack_quantized_hand_built_signed_levels_and_zero_points() -> None:
    # row 0 holds signed levels -8..-1 (stored unsigned 0..7); zero points of outputs 0..7 are -8..-1
    packed = torch.zeros(8, 1, dtype=torch.int32)
    packed[0, 0] = 0x76543210
    tensors = {
        "weight_packed": packed,
        "weight_scale": torch.full((8, 1), 2.0, dtype=torch.bfloat16),
        "weight_shape": torch.tensor([8, 8]),
        "weight_zero_point": torch.tensor([[0x76543210]], dtype=torch.int32),
    }
    q = unpack_pack_quantized(tensors, 4, -1)
    assert q.qweight[0].tolist() == list(range(8)) and q.zeros.flatten().tolist() == list(range(8))
    assert dequantize_weight(q)[0].tolist() == [2.0 * v for v in range(8)]  # (level - zero of output 0) * 2
    older = {**tensors, "weight_zero_point": torch.arange(-8, 0, dtype=torch.int8).reshape(8, 1)}
    assert torch.equal(unpack_pack_quantized(older, 4, -1).zeros, q.zeros)


@pytest.mark.parametrize("is_per_channel", [True, False])
def test_float_quantized_round_trips(is_per_channel) -> None:
    q = quantize_fp8_weight(torch.randn(16, 32), is_per_channel, input_scale=torch.tensor([0.01]))
    tensors = pack_float_quantized(q)
    assert tensors["weight_scale"].shape == ((16, 1) if is_per_channel else (1,))
    back = unpack_float_quantized(tensors)
    assert torch.equal(back.qweight.view(torch.uint8), q.qweight.view(torch.uint8))
    assert torch.equal(back.scales, q.scales) and torch.equal(back.input_scale, q.input_scale)


# --- dispatch and fusion ---

GPTQ_SPEC = ImportSpec("gptq", "gptq-v1", 4, 32, True, False)


def test_unpack_module_checks_shapes_against_the_model(make_qweight) -> None:
    tensors = pack_gptq(make_qweight(4, 32, True, out_features=32, in_features=128))
    assert unpack_module(GPTQ_SPEC, "layers.0.q", tensors, 128, 32).in_features == 128
    with pytest.raises(
        CheckpointError, match=r"layers.0.q.qweight has shape \[16, 32\], expected \[32, 32\]"
    ):
        unpack_module(GPTQ_SPEC, "layers.0.q", tensors, 256, 32)
    with pytest.raises(CheckpointError, match="lacks"):
        unpack_module(GPTQ_SPEC, "layers.0.q", {"qweight": tensors["qweight"]}, 128, 32)
    asymmetric = pack_gptq(make_qweight(4, 32, False, out_features=32, in_features=128))
    with pytest.raises(CheckpointError, match="symmetric"):
        unpack_module(GPTQ_SPEC, "layers.0.q", asymmetric, 128, 32)
    # act-order groups the config does not declare: named with the config fields, not the format's internals
    shuffled = make_qweight(4, 32, True, out_features=32, in_features=128)
    shuffled.g_idx = torch.randperm(128, generator=torch.Generator().manual_seed(0)).to(torch.int32) // 32
    with pytest.raises(CheckpointError, match="layers.0.q has act-order groups .* desc_act"):
        unpack_module(GPTQ_SPEC, "layers.0.q", pack_gptq(shuffled), 128, 32)
    # compressed-tensors' weight_shape must be the model's [out, in]
    packed = pack_pack_quantized(make_qweight(4, 32, True, out_features=32, in_features=128))
    ct_spec = ImportSpec("compressed-tensors", "pack-quantized", 4, 32, True, False)
    assert unpack_module(ct_spec, "layers.0.q", packed, 128, 32).out_features == 32
    packed["weight_shape"] = torch.tensor([32, 120])
    with pytest.raises(CheckpointError, match=r"weight_shape says \[32, 120\].* \[32, 128\]"):
        unpack_module(ct_spec, "layers.0.q", packed, 128, 32)


def test_concat_out_fuses_along_outputs(make_qweight) -> None:
    parts = [
        make_qweight(4, 32, True, out_features=8, seed=1),
        make_qweight(4, 32, False, out_features=4, seed=2),
    ]
    fused = concat_out(parts)
    assert fused.out_features == 12 and fused.zeros is not None
    torch.testing.assert_close(dequantize_weight(fused), torch.cat([dequantize_weight(p) for p in parts]))


def test_concat_out_refuses_mismatched_settings(make_qweight) -> None:
    with pytest.raises(CheckpointError, match="bits"):
        concat_out([make_qweight(4, 32, True), make_qweight(8, 32, True)], names=("q_proj", "k_proj"))
    with pytest.raises(CheckpointError, match="g_idx"):
        concat_out(
            [
                make_qweight(4, 32, True, is_act_order=True, seed=1),
                make_qweight(4, 32, True, is_act_order=True, seed=2),
            ]
        )


def test_concat_out_fp8_per_tensor_scales_become_per_channel() -> None:
    parts = [quantize_fp8_weight(torch.randn(4, 16) * s, False, torch.tensor([s])) for s in (1.0, 3.0)]
    fused = concat_out(parts)
    assert fused.scales.shape == (8, 1)
    torch.testing.assert_close(fused.input_scale, torch.tensor([3.0]))
    torch.testing.assert_close(dequantize_weight(fused), torch.cat([dequantize_weight(p) for p in parts]))
