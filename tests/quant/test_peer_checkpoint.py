"""The real llm-compressor sample (compressed-tensors pack-quantized W4A16 g128) imports correctly."""

import json
from pathlib import Path

import torch
from safetensors import safe_open

from llmc.quant.formats import make_format
from llmc.quant.import_config import parse_quantization_config
from llmc.quant.importers import unpack_module
from llmc.quant.reference import dequantize, dequantize_weight
from llmc.quant.rtn import compute_qparams

CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"
PEER = CHECKPOINTS / "peer-gptq-w4a16-g128"
ORIGINAL = CHECKPOINTS / "ref-llama-12m"


def original_weight(name: str) -> torch.Tensor:
    shard = json.loads((ORIGINAL / "model.safetensors.index.json").read_text())["weight_map"][name]
    with safe_open(ORIGINAL / shard, "pt") as f:
        return f.get_tensor(name).float()


def peer_modules() -> dict[str, dict[str, torch.Tensor]]:
    modules: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(PEER / "model.safetensors", "pt") as f:
        for key in f.keys():
            module, tensor = key.rsplit(".", 1)
            if module.startswith("model.layers."):
                modules.setdefault(module, {})[tensor] = f.get_tensor(key)
    return {m: t for m, t in modules.items() if "weight_packed" in t}


def test_peer_sample_dequantizes_close_to_the_original_checkpoint() -> None:
    spec = parse_quantization_config(json.loads((PEER / "config.json").read_text()))
    fmt = make_format(spec.format_spec(), torch.bfloat16)
    modules = peer_modules()
    assert len(modules) == 6 * 7
    for name, tensors in modules.items():
        out_features, in_features = tensors["weight_shape"].tolist()
        q = unpack_module(spec, name, tensors, in_features, out_features)
        weight = dequantize_weight(q)
        original = original_weight(name + ".weight")
        assert (weight - original).abs().mean() / original.abs().mean() < 0.2, name
        assert torch.equal(dequantize(fmt, fmt.pack(q)), weight), name  # bf16 scales pack losslessly


def test_peer_scales_follow_our_symmetric_convention() -> None:
    # static act-order takes each group's scale from the original weight: absmax / 7.5, stored in bf16
    tensors = peer_modules()["model.layers.2.mlp.gate_proj"]
    original = original_weight("model.layers.2.mlp.gate_proj.weight")
    scales, zeros = compute_qparams(
        original.reshape(original.shape[0], -1, 128), 4, True, scale_dtype=torch.bfloat16
    )
    assert zeros is None
    assert torch.equal(scales, tensors["weight_scale"].float())
