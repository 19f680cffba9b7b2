"""Import audit: configs and tensors that used to import silently wrong (or crash at load) are refused in
one line; layouts that used to be refused although published import."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmc.errors import CheckpointError
from llmc.quant.formats import QuantizedWeight
from llmc.quant.import_config import check_module_tensors, parse_quantization_config
from llmc.quant.importers import pack_gptq, pack_pack_quantized, unpack_module

W4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}


def ct(weights=W4, fmt="pack-quantized", act=None, **extra) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"], "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": act}}, **extra}


QUIP = {"config_groups": {"v": {"type": "hadamard", "apply": [
    {"targets": ["Linear"], "location": "input", "ignore": "lm_head"},
    {"targets": ["Linear"], "location": "weight_input", "inverse": True, "ignore": "lm_head"}]}}}


@pytest.mark.parametrize("config,message", [
    (ct(transform_config=QUIP), "transform_config"),
    (ct(config_groups={"group_0": {"targets": ["Linear"], "weights": W4, "input_activations": None,
                                   "output_activations": {"num_bits": 8, "type": "float", "strategy": "tensor"}}}),
     "output_activations"),
    (ct({"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block", "block_structure": [128, 128]},
        "float-quantized", {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}),
     "block weights \\[128, 128\\] with input_activations strategy 'token'"),
    (ct({**W4, "strategy": "tensor"}), "strategy 'tensor'"),
    (ct(sparsity_config={"format": "sparse-24-bitmask"}), "sparse-24-bitmask"),
])
def test_unsupported_compressed_tensors_are_named(config, message) -> None:
    with pytest.raises(CheckpointError, match=message) as error:
        parse_quantization_config(config)
    assert "\n" not in str(error.value)


def test_empty_transform_config_still_imports() -> None:  # llm-compressor writes "transform_config": {}
    assert parse_quantization_config(ct(transform_config={})).layout == "pack-quantized"


def _gptq_tensors(desc_act: bool):
    gen = torch.Generator().manual_seed(0)
    g_idx = torch.randperm(128, generator=gen) // 64 if desc_act else torch.arange(128) // 64
    q = QuantizedWeight(torch.randint(0, 16, (32, 128), generator=gen, dtype=torch.int32),
                        torch.rand(32, 2, generator=gen) + 0.1, None, 4, 64, g_idx=g_idx.to(torch.int32))
    return pack_gptq(q)


GPTQ_ACT = parse_quantization_config({"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True})
GPTQ = parse_quantization_config({"quant_method": "gptq", "bits": 4, "group_size": 64})


def test_gptq_desc_act_without_g_idx_is_refused() -> None:
    tensors = _gptq_tensors(True)
    del tensors["g_idx"]  # the permuted groups are lost: contiguous groups would be silently wrong
    with pytest.raises(CheckpointError, match="lacks \\['g_idx'\\]"):
        unpack_module(GPTQ_ACT, "m", tensors, 128, 32)


@pytest.mark.parametrize("bad", [7, -1])
def test_g_idx_out_of_range_is_refused_at_build(bad) -> None:
    tensors = _gptq_tensors(True)
    tensors["g_idx"][0] = bad
    with pytest.raises(CheckpointError, match="g_idx holds groups"):
        unpack_module(GPTQ_ACT, "m", tensors, 128, 32)


@pytest.mark.parametrize("name,dtype", [("qweight", torch.float32), ("qweight", torch.int64), ("qzeros", torch.float16),
                                        ("scales", torch.int32), ("g_idx", torch.float32)])
def test_wrong_dtypes_are_refused(name, dtype) -> None:
    tensors = _gptq_tensors(False)
    tensors[name] = tensors[name].to(dtype)
    with pytest.raises(CheckpointError, match=f"{name} has dtype"):
        check_module_tensors(GPTQ, "m", tensors, 128, 32)


def test_pack_quantized_float_weight_packed_is_refused() -> None:
    q = QuantizedWeight(torch.randint(0, 16, (32, 128), dtype=torch.int32), torch.rand(32, 2) + 0.1, None, 4, 64)
    tensors = pack_pack_quantized(q)
    tensors["weight_packed"] = tensors["weight_packed"].float()
    with pytest.raises(CheckpointError, match="weight_packed has dtype torch.float32"):
        unpack_module(parse_quantization_config(ct()), "m", tensors, 128, 32)


def test_unpacked_signed_zero_points_of_older_compressed_tensors_import() -> None:
    gen = torch.Generator().manual_seed(0)
    zeros = torch.randint(0, 16, (32, 2), generator=gen, dtype=torch.int32)
    q = QuantizedWeight(torch.randint(0, 16, (32, 128), generator=gen, dtype=torch.int32), torch.rand(32, 2) + 0.1,
                        zeros, 4, 64)
    tensors = pack_pack_quantized(q)
    tensors["weight_zero_point"] = (zeros - 8).to(torch.int8)  # [out, G] signed, as before zero-point packing
    got = unpack_module(parse_quantization_config(ct({**W4, "symmetric": False})), "m", tensors, 128, 32)
    assert torch.equal(got.zeros, zeros) and torch.equal(got.qweight, q.qweight)


def test_quantize_config_json_alone_is_read(tiny_llama, tmp_path) -> None:
    """AutoGPTQ checkpoints that keep their config only in quantize_config.json (vLLM reads it too)."""
    from llmc.compiler.build import build
    from llmc.compiler.recipe import recipe_from_dict
    from llmc.quant.rtn import rtn_quantize

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_llama, ckpt)
    tensors = load_file(ckpt / "model.safetensors")
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        q = rtn_quantize(tensors.pop(name), 4, 32, True, scale_dtype=torch.float16)
        tensors |= {f"{name[:-len('.weight')]}.{k}": v for k, v in pack_gptq(q).items()}
    save_file(tensors, ckpt / "model.safetensors")
    (ckpt / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 32, "sym": True, "desc_act": False}))
    out = tmp_path / "artifact"
    build(recipe_from_dict({"model": str(ckpt), "output": str(out), "quantization": {"method": "import"}}),
          show_progress=False)
    assert json.loads((out / "manifest.json").read_text())["quant"]["modules"]["layers.0.attn.qkv"]["format"] == "w4a16"


def test_compressed_tensors_plain_ignore_entries_are_whole_module_names() -> None:
    """compressed-tensors' match_name: `target == name` (or re:); a parent module's name ignores no Linear."""
    spec = parse_quantization_config(ct(ignore=["lm_head", "model.layers.0.mlp", "model.layers.1.self_attn.q_proj"]))
    assert spec.is_ignored("lm_head") and spec.is_ignored("model.layers.1.self_attn.q_proj")
    assert not spec.is_ignored("model.layers.0.mlp.gate_proj")
    assert not spec.is_ignored("model.layers.11.self_attn.q_proj")


def test_config_groups_differing_only_in_calibration_fields_import_as_one() -> None:
    groups = {"group_0": {"targets": ["re:.*self_attn.*"], "weights": {**W4, "observer": "mse", "actorder": "static"}},
              "group_1": {"targets": ["re:.*mlp.*"], "weights": {**W4, "observer": "minmax", "actorder": None}}}
    spec = parse_quantization_config(ct(config_groups=groups))
    assert (spec.bits, spec.group_size, spec.is_act_order) == (4, 64, False)
    groups["group_1"]["weights"] = {**W4, "num_bits": 8}
    with pytest.raises(CheckpointError, match="weights differ in num_bits"):
        parse_quantization_config(ct(config_groups=groups))
