"""parse_quantization_config: the three families, unsupported configs, ignores, tensor checks."""

import pytest
import torch

from llmc.errors import CheckpointError
from llmc.quant.import_config import check_module_tensors, parse_quantization_config


def compressed_tensors_config(
    weights: dict, input_activations: dict | None = None, fmt: str = "pack-quantized"
) -> dict:
    scheme = {"targets": ["Linear"], "weights": weights, "input_activations": input_activations}
    return {
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "format": fmt,
            "ignore": ["lm_head", "re:.*gate$"],
            "config_groups": {"group_0": scheme},
            "quantization_status": "compressed",
        }
    }


W4A16 = {
    "num_bits": 4,
    "type": "int",
    "symmetric": True,
    "strategy": "group",
    "group_size": 128,
    "actorder": "static",
}


def test_compressed_tensors_w4a16_static_act_order_needs_no_g_idx() -> None:
    spec = parse_quantization_config(compressed_tensors_config(W4A16))
    assert (spec.layout, spec.bits, spec.group_size, spec.is_symmetric, spec.is_act_order) == (
        "pack-quantized",
        4,
        128,
        True,
        False,
    )
    assert spec.format_spec() == {
        "format": "w4a16",
        "bits": 4,
        "group_size": 128,
        "symmetric": True,
        "has_g_idx": False,
    }
    assert spec.required_tensor_names() == ("weight_packed", "weight_scale", "weight_shape")


def test_compressed_tensors_variants() -> None:
    group_order = parse_quantization_config(
        compressed_tensors_config({**W4A16, "actorder": "group", "symmetric": False})
    )
    assert group_order.is_act_order and not group_order.is_symmetric
    assert (
        "weight_g_idx" in group_order.required_tensor_names()
        and "weight_zero_point" in group_order.required_tensor_names()
    )
    channel = parse_quantization_config(
        compressed_tensors_config({**W4A16, "num_bits": 8, "strategy": "channel", "group_size": None})
    )
    assert (channel.bits, channel.group_size) == (8, -1)


@pytest.mark.parametrize("dynamic,strategy", [(True, "token"), (False, "tensor")])
def test_compressed_tensors_fp8(dynamic, strategy) -> None:
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
    activations = {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "strategy": strategy,
        "dynamic": dynamic,
    }
    spec = parse_quantization_config(compressed_tensors_config(weights, activations, "float-quantized"))
    assert spec.is_fp8 and spec.is_static_input == (not dynamic)
    assert spec.format_spec() == {
        "format": "w8a8-fp8",
        "is_per_channel": True,
        "is_static_input": not dynamic,
    }


def test_awq_and_gptq_configs() -> None:
    awq = parse_quantization_config(
        {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
    )
    assert (awq.layout, awq.is_symmetric, awq.is_ignored("lm_head")) == ("awq-gemm", False, True)
    gptq = parse_quantization_config(
        {"quant_method": "gptq", "bits": 3, "group_size": 64, "desc_act": True, "sym": False}
    )
    assert (gptq.layout, gptq.bits, gptq.is_act_order, gptq.is_symmetric) == ("gptq-v1", 3, True, False)
    assert gptq.format_spec()["has_g_idx"] is True
    v2 = parse_quantization_config(
        {"quant_method": "gptq", "bits": 4, "group_size": -1, "checkpoint_format": "gptq_v2"}
    )
    assert v2.layout == "gptq-v2"


@pytest.mark.parametrize(
    "config,message",
    [
        ({"quant_method": "bitsandbytes"}, "supported: awq"),
        ({}, "supported"),
        ({"quant_method": "awq", "version": "gemv"}, "GEMM"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "gptq_v2"),
        ({"quant_method": "gptq", "bits": 2, "group_size": 128}, "3, 4 or 8"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 256}, "group_size 256"),
        # numbers and flags of another JSON type: one line, not an unpacking traceback or bool("false")
        ({"quant_method": "gptq", "bits": 4.0, "group_size": 128}, r"bits is 4\.0 \(float\)"),
        ({"quant_method": "gptq", "bits": 4, "group_size": "128"}, r"group_size is '128' \(str\)"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": "false"}, "sym is 'false'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": "true"}, "lm_head is 'true'"),
        (compressed_tensors_config({**W4A16, "num_bits": "4"}), "num_bits|bits is '4'"),
        (compressed_tensors_config({**W4A16, "symmetric": "false"}), "symmetric is 'false'"),
        (compressed_tensors_config(W4A16, {"num_bits": 8, "type": "int"}), "W4A8"),
        (compressed_tensors_config(W4A16, fmt="marlin-24"), "marlin-24"),
        (
            compressed_tensors_config(
                {"num_bits": 8, "type": "float", "strategy": "channel"}, None, "float-quantized"
            ),
            "weight-only",
        ),
    ],
)
def test_unsupported_configs_raise_checkpoint_errors(config, message) -> None:
    with pytest.raises(CheckpointError, match=message):
        parse_quantization_config(config)


def test_gptq_lm_head_flag_says_whether_the_head_is_quantized() -> None:
    """GPTQModel / AutoGPTQ `lm_head: true` packs lm_head like the other linears; false (the default) leaves it dense."""
    config = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    assert parse_quantization_config(config).is_ignored("lm_head")
    assert parse_quantization_config({**config, "lm_head": False}).is_ignored("lm_head")
    head = parse_quantization_config({**config, "lm_head": True})
    assert not head.is_ignored("lm_head") and not head.is_ignored("model.layers.0.mlp.down_proj")


def test_ignored_modules_match_names_and_regexes() -> None:
    spec = parse_quantization_config(compressed_tensors_config(W4A16))
    assert spec.is_ignored("lm_head")
    assert spec.is_ignored("model.layers.0.mlp.gate")
    assert not spec.is_ignored("model.layers.0.mlp.gate_proj")
    assert not spec.is_ignored("model.lm_head_extra")


def test_check_module_tensors_names_the_mismatch_in_one_line() -> None:
    spec = parse_quantization_config({"quant_method": "gptq", "bits": 8, "group_size": 128})
    four_bit = {
        "qweight": torch.zeros(32, 64, dtype=torch.int32),
        "qzeros": torch.zeros(2, 8, dtype=torch.int32),
        "scales": torch.zeros(2, 64, dtype=torch.float16),
    }
    with pytest.raises(CheckpointError) as error:
        check_module_tensors(spec, "model.layers.0.self_attn.q_proj", four_bit, 256, 64)
    message = str(error.value)
    assert "\n" not in message and "q_proj.qweight" in message and "[64, 64]" in message
    check_module_tensors(
        parse_quantization_config({"quant_method": "gptq", "bits": 4, "group_size": 128}),
        "model.layers.0.self_attn.q_proj",
        four_bit,
        256,
        64,
    )


def test_gptqmodel_pack_dtype_other_than_int32_is_refused_by_name() -> None:
    base = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    for pack_dtype in (None, "int32", "torch.int32"):
        assert parse_quantization_config({**base, "pack_dtype": pack_dtype}).layout == "gptq-v1"
    with pytest.raises(CheckpointError, match="GPTQ pack_dtype 'int16' is not supported.*re-export with pack_dtype int32"):
        parse_quantization_config({**base, "pack_dtype": "int16"})
