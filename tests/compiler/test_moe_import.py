"""Importing quantized mixture-of-experts checkpoints (`quantization.method: import`).

The checkpoints are written here, independently of llmc's importers, in the layout llm-compressor
saves (compressed-tensors `pack-quantized`, one module per expert, the router in `ignore`), by
float64 math on the published format: signed levels offset by 2**(bits-1) and packed 32 // bits to an
int32 word along the input dim (element 8j + k at bits 4k of word j), zero points packed the same way
along the output dim, scales [out, groups] in bfloat16, `weight_shape` = (out, in). The oracle is
transformers running the dequantized weights in float32.
"""

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import CheckpointError
from llmc.quant.formats import make_format
from llmc.quant.reference import dequantize
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

BITS = 4
PROMPTS = ["ROMEO:", "The quick brown fox jumps over the lazy dog, and then", "In the beginning"]
NUM_NEW_TOKENS = 24
# family → (router module in a layer, compressed-tensors weights scheme): Mixtral W4A16 symmetric in
# groups of 32; Qwen3-MoE W4A16 asymmetric per channel (packed zero points).
CASES = {
    "mixtral": ("block_sparse_moe.gate", {"strategy": "group", "group_size": 32, "symmetric": True}),
    "qwen3_moe": ("mlp.gate", {"strategy": "channel", "symmetric": False}),
}
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def _pack_int32(unsigned: np.ndarray) -> torch.Tensor:
    """[rows, n] values in [0, 16) → [rows, ceil(n / 8)] int32, element 8j + k in bits 4k..4k+3 of word j."""
    per_word = 32 // BITS
    rows, n = unsigned.shape
    padded = np.zeros((rows, -(-n // per_word) * per_word), dtype=np.uint64)
    padded[:, :n] = unsigned
    words = (padded.reshape(rows, -1, per_word) << (BITS * np.arange(per_word, dtype=np.uint64))).sum(axis=2)
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def _compress(weight: torch.Tensor, scheme: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One linear in compressed-tensors pack-quantized form, and its dequantized weight (float64)."""
    w = weight.double()
    out_features, in_features = w.shape
    group_size = scheme.get("group_size", in_features)
    groups = w.reshape(out_features, in_features // group_size, group_size)
    q_min, q_max = -(2 ** (BITS - 1)), 2 ** (BITS - 1) - 1
    if scheme["symmetric"]:
        scale = groups.abs().amax(dim=2) / ((q_max - q_min) / 2)
        scale = scale.to(torch.bfloat16).double()  # the scale as stored
        zero = torch.zeros_like(scale)
    else:
        low, high = groups.amin(dim=2).clamp(max=0), groups.amax(dim=2).clamp(min=0)
        scale = ((high - low) / (q_max - q_min)).to(torch.bfloat16).double()
        zero = (q_min - torch.round(low / scale)).clamp(q_min, q_max)
    levels = (torch.round(groups / scale[..., None]) + zero[..., None]).clamp(q_min, q_max)  # signed
    dequantized = ((levels - zero[..., None]) * scale[..., None]).reshape(out_features, in_features)
    offset = 2 ** (BITS - 1)
    tensors = {
        "weight_packed": _pack_int32((levels.reshape(out_features, in_features) + offset).numpy().astype(np.uint64)),
        "weight_scale": scale.to(torch.bfloat16).contiguous(),
        "weight_shape": torch.tensor([out_features, in_features], dtype=torch.int64),
    }
    if not scheme["symmetric"]:  # packed along the output dim: [ceil(out / 8), groups]
        tensors["weight_zero_point"] = _pack_int32((zero + offset).numpy().astype(np.uint64).T).T.contiguous()
    return tensors, dequantized


def _write_checkpoint(source, family, dest, dequantized_dest):
    """`source` with every attention, MLP and expert linear compressed; the dequantized float twin beside it.
    Returns {HF module: dequantized weight float64}."""
    router, scheme = CASES[family]
    for path in (dest, dequantized_dest):
        shutil.copytree(source, path)
    float_tensors = load_file(source / "model.safetensors")
    tensors, twin, dequantized = {}, dict(float_tensors), {}
    for name, weight in float_tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in QUANTIZED:
            packed, dequantized[module] = _compress(weight, scheme)
            tensors |= {f"{module}.{k}": v for k, v in packed.items()}
            twin[name] = dequantized[module].float()
        else:
            tensors[name] = weight
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    save_file(twin, dequantized_dest / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head", f"re:.*{router.replace('.', '[.]')}$"],
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                      "weights": {"num_bits": BITS, "type": "int", "dynamic": False, **scheme}}},
    }
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dequantized


@pytest.fixture(scope="module", params=list(CASES))
def imported(request, tmp_path_factory):
    """(family, float checkpoint, quantized checkpoint, dequantized twin, dequantized weights, artifact)."""
    family = request.param
    source = request.getfixturevalue(f"tiny_{family}")
    root = tmp_path_factory.mktemp(f"moe_import_{family}")
    dequantized = _write_checkpoint(source, family, root / "ckpt", root / "dequantized")
    build(recipe_from_dict({"model": str(root / "ckpt"), "output": str(root / "artifact"), "dtype": "float32",
                            "target": {"device": "cpu"}, "runtime": {"max_model_len": 256},
                            "quantization": {"method": "import"}}), show_progress=False)
    return family, source, root / "ckpt", root / "dequantized", dequantized, root / "artifact"


def test_every_expert_holds_the_checkpoint_levels_and_the_router_stays_dense(imported):
    family, source, _, _, dequantized, artifact = imported
    router, _ = CASES[family]
    manifest = json.loads((artifact / "manifest.json").read_text())
    config = manifest["model"]
    weights = load_file(artifact / "rank-00" / "weights.safetensors")
    float_tensors = load_file(source / "model.safetensors")
    moe_names = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}[family]
    expert_prefix = router.rsplit(".", 1)[0] + ".experts"
    assert config["moe_layers"]
    for i in config["moe_layers"]:
        modules = manifest["quant"]["modules"]
        assert modules[f"layers.{i}.moe.experts.gate_up"]["format"] == "w4a16"
        gate, up, down = (f"model.layers.{i}.{expert_prefix}.{{}}.{m}" for m in moe_names)
        for proj, members, in_features in (("gate_up", (gate, up), config["hidden_size"]),
                                           ("down", (down,), config["moe_intermediate_size"])):
            fmt = make_format(modules[f"layers.{i}.moe.experts.{proj}"], torch.float32)
            stacked = {k.rsplit(".", 1)[1]: v for k, v in weights.items() if k.startswith(f"layers.{i}.moe.experts.{proj}.")}
            assert all(t.shape[0] == config["num_experts"] for t in stacked.values())
            for e in range(config["num_experts"]):
                ours = dequantize(fmt, {k: v[e] for k, v in stacked.items()}, in_features)
                theirs = torch.cat([dequantized[m.format(e)] for m in members]).float()
                assert torch.equal(ours, theirs), (i, proj, e)
        # the router: not in the format table, stored dense, bit-equal to the checkpoint's
        assert f"layers.{i}.moe.gate" not in modules
        assert torch.equal(weights[f"layers.{i}.moe.gate.weight"], float_tensors[f"model.layers.{i}.{router}.weight"])


def test_greedy_and_logits_match_transformers_on_the_dequantized_model(imported, hf_greedy, hf_encode, hf_logits):
    family, _, _, twin, _, artifact = imported
    llm = LLM(artifact, device="cpu")
    outputs = llm.generate([{"prompt_token_ids": hf_encode(twin, p)} for p in PROMPTS],
                           SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS))
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(twin, PROMPTS, NUM_NEW_TOKENS), family
    token_ids = hf_encode(twin, PROMPTS[1]) + list(range(100, 120))
    torch.testing.assert_close(llm.engine.score(token_ids), hf_logits(twin, token_ids), atol=1e-4, rtol=1e-4)


# Each case edits one expert's tensors of the quantized checkpoint: (edit, the error it must give).
MUTATIONS = {
    "missing scale": (lambda t, m: t.pop(f"{m}.weight_scale"), r"{m} lacks \['weight_scale'\]"),
    "wrong shape": (lambda t, m: t.update({f"{m}.weight_packed": t[f"{m}.weight_packed"][:, :-1].contiguous()}),
                    r"{m}\.weight_packed has shape \[\d+, \d+\], expected"),
    "expert absent": (lambda t, m: [t.pop(k) for k in [k for k in t if k.startswith(m + ".")]], r"no tensors of {m},"),
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_broken_expert_is_one_error_line(mutation, imported, tmp_path):
    family, _, ckpt, _, _, _ = imported
    # the last MoE layer's expert 2 up projection (Qwen3-MoE's layer 1 is dense)
    module = {"mixtral": "model.layers.1.block_sparse_moe.experts.2.w3", "qwen3_moe": "model.layers.2.mlp.experts.2.up_proj"}[family]
    edit, message = MUTATIONS[mutation]
    broken = tmp_path / "ckpt"
    shutil.copytree(ckpt, broken)
    tensors = load_file(broken / "model.safetensors")
    edit(tensors, module)
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match=message.format(m=module.replace(".", r"\."))) as error:
        build(recipe_from_dict({"model": str(broken), "output": str(tmp_path / "o"), "target": {"device": "cpu"},
                                "quantization": {"method": "import"}}), show_progress=False)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "o").exists()
