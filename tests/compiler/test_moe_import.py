"""Importing quantized mixture-of-experts checkpoints (`quantization.method: import`).

The checkpoints are written here, independently of llmc's importers, in the layout llm-compressor
saves (compressed-tensors `pack-quantized`, one module per expert, the router in `ignore`), by
float64 math on the published format: signed levels offset by 2**(bits-1) and packed 32 // bits to an
int32 word along the input dim (element 8j + k at bits 4k of word j), zero points packed the same way
along the output dim, scales [out, groups] in bfloat16, `weight_shape` = (out, in). The oracle is
transformers running the dequantized weights in float32.
"""

import json
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import CheckpointError
from llmc.quant.formats import make_format
from llmc.quant.importers import pack_awq_gemm, pack_gptq
from llmc.quant.reference import dequantize, dequantize_weight
from llmc.quant.rtn import rtn_quantize
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


def _write_checkpoint(source, family, dest, dequantized_dest, targets=("Linear",)):
    """`source` with every attention, MLP and expert linear that `targets` match compressed; the dequantized
    float twin beside it. Returns {HF module: dequantized weight float64}."""
    router, scheme = CASES[family]
    is_target = (lambda m: True) if targets == ("Linear",) else (lambda m: any(re.match(t[3:], m) for t in targets))
    for path in (dest, dequantized_dest):
        shutil.copytree(source, path)
    float_tensors = load_file(source / "model.safetensors")
    tensors, twin, dequantized = {}, dict(float_tensors), {}
    for name, weight in float_tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in QUANTIZED and is_target(module):
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
        "config_groups": {"group_0": {"targets": list(targets), "input_activations": None, "output_activations": None,
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


def test_a_quantized_router_or_partly_ignored_experts_are_refused_in_one_line(imported, tmp_path):
    """llmc keeps routers dense and one format per projection for all of a layer's experts: a checkpoint
    whose router was quantized, or whose ignore list covers only some experts, is refused by name."""
    family, _, ckpt, _, dequantized, _ = imported
    router = f"model.layers.0.{CASES[family][0]}"
    quantized_router = tmp_path / "router"
    shutil.copytree(ckpt, quantized_router)
    tensors = load_file(quantized_router / "model.safetensors")
    packed, _ = _compress(tensors.pop(f"{router}.weight"), {"strategy": "channel", "symmetric": True})
    save_file(tensors | {f"{router}.{k}": v for k, v in packed.items()}, quantized_router / "model.safetensors")
    partly = tmp_path / "partly"
    shutil.copytree(ckpt, partly)
    config = json.loads((partly / "config.json").read_text())
    expert = next(m for m in dequantized if ".experts.1." in m and m.startswith("model.layers.0."))
    config["quantization_config"]["ignore"].append(expert)
    (partly / "config.json").write_text(json.dumps(config))
    for checkpoint, message in ((quantized_router, f"router {router} has .*weight_packed.* instead of a dense weight"),
                                (partly, r"layers\.0\.moe\.experts\.(gate_up|down) fuses \d+ .* only some")):
        with pytest.raises(CheckpointError, match=message) as error:
            build(recipe_from_dict({"model": str(checkpoint), "output": str(tmp_path / "o"),
                                    "quantization": {"method": "import"}}), show_progress=False)
        assert "\n" not in str(error.value)


# AutoAWQ and GPTQ MoE checkpoints name their experts the same way; their packing is tested against
# hand-built words in tests/quant/test_importers.py, so these fixtures use llmc's writers (as the dense
# import tests do). AutoAWQ leaves the router out through modules_to_not_convert ["gate"]; GPTQModel never
# quantizes it and lists nothing.
PEER_FORMATS = {
    "awq": (lambda q: pack_awq_gemm(q), False, {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                                 "version": "gemm", "modules_to_not_convert": ["gate"]}),
    "gptq": (lambda q: pack_gptq(q, is_v1=True), True, {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                                         "sym": True, "desc_act": False}),
}


@pytest.mark.parametrize("kind", list(PEER_FORMATS))
def test_awq_and_gptq_moe_checkpoints_import_the_same_way(kind, tiny_mixtral, tmp_path, hf_logits, hf_encode):
    pack, symmetric, qconfig = PEER_FORMATS[kind]
    ckpt, twin = tmp_path / "ckpt", tmp_path / "dequantized"
    for path in (ckpt, twin):
        shutil.copytree(tiny_mixtral, path)
    tensors = load_file(tiny_mixtral / "model.safetensors")
    twin_tensors = dict(tensors)
    for name in [n for n in tensors if n.removesuffix(".weight").rsplit(".", 1)[-1] in QUANTIZED]:
        q = rtn_quantize(tensors.pop(name), 4, 32, symmetric, scale_dtype=torch.float16)
        tensors |= {f"{name.removesuffix('.weight')}.{k}": v for k, v in pack(q).items()}
        twin_tensors[name] = dequantize_weight(q)
    save_file(tensors, ckpt / "model.safetensors")
    save_file(twin_tensors, twin / "model.safetensors")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "quantization_config": qconfig}))
    out = tmp_path / "artifact"
    build(recipe_from_dict({"model": str(ckpt), "output": str(out), "dtype": "float32", "target": {"device": "cpu"},
                            "runtime": {"max_model_len": 256}, "quantization": {"method": "import"}}), show_progress=False)
    weights = load_file(out / "rank-00" / "weights.safetensors")
    assert weights["layers.1.moe.experts.down.scales"].shape[0] == 4
    assert torch.equal(weights["layers.1.moe.gate.weight"], twin_tensors["model.layers.1.block_sparse_moe.gate.weight"])
    token_ids = hf_encode(twin, PROMPTS[1]) + list(range(100, 120))
    torch.testing.assert_close(LLM(out, device="cpu").engine.score(token_ids), hf_logits(twin, token_ids),
                               atol=1e-4, rtol=1e-4)


def test_fp8_moe_checkpoint_keeps_each_experts_scales(tiny_mixtral, tmp_path):
    """compressed-tensors float-quantized (FP8 W8A8, static input scales): every expert's E4M3 weight and
    per-channel scale land in the artifact as stored; gate and up share one input scale, their max."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_mixtral, ckpt)
    tensors, expected = load_file(tiny_mixtral / "model.safetensors"), {}
    gen = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.removesuffix(".weight").rsplit(".", 1)[-1] in QUANTIZED]:
        weight, module = tensors.pop(name), name.removesuffix(".weight")
        scale = weight.abs().amax(dim=1, keepdim=True) / 448.0  # E4M3's largest finite value
        expected[module] = {"weight": (weight / scale).to(torch.float8_e4m3fn), "weight_scale": scale,
                            "input_scale": torch.rand(1, generator=gen) + 0.01}
        tensors |= {f"{module}.{k}": v for k, v in expected[module].items()}
    save_file(tensors, ckpt / "model.safetensors")
    scheme = {"weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
              "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True,
                                    "dynamic": False}, "targets": ["Linear"]}
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                     "ignore": ["lm_head", "re:.*block_sparse_moe[.]gate$"],
                                     "config_groups": {"group_0": scheme}}
    (ckpt / "config.json").write_text(json.dumps(config))
    out = tmp_path / "artifact"
    build(recipe_from_dict({"model": str(ckpt), "output": str(out), "dtype": "float32", "target": {"device": "cpu"},
                            "quantization": {"method": "import"}}), show_progress=False)
    weights = load_file(out / "rank-00" / "weights.safetensors")
    for e in range(4):
        gate, up, down = (expected[f"model.layers.0.block_sparse_moe.experts.{e}.{m}"] for m in ("w1", "w3", "w2"))
        stacked = {k.rsplit(".", 1)[1]: v[e] for k, v in weights.items() if k.startswith("layers.0.moe.experts.gate_up.")}
        assert torch.equal(stacked["weight"].view(torch.uint8), torch.cat([gate["weight"], up["weight"]]).view(torch.uint8))
        assert torch.equal(stacked["weight_scale"].reshape(-1), torch.cat([gate["weight_scale"], up["weight_scale"]]).reshape(-1))
        assert torch.equal(stacked["input_scale"].reshape(1), torch.maximum(gate["input_scale"], up["input_scale"]))
        assert torch.equal(weights["layers.0.moe.experts.down.input_scale"][e].reshape(1), down["input_scale"])


def test_expert_parallel_import_gives_each_rank_exactly_its_experts(imported, tmp_path):
    family, _, ckpt, _, _, artifact = imported
    out = tmp_path / "ep2"
    build(recipe_from_dict({"model": str(ckpt), "output": str(out), "dtype": "float32", "target": {"device": "cpu"},
                            "parallel": {"tensor": 2, "expert": 2}, "quantization": {"method": "import"}}),
          show_progress=False)
    whole = load_file(artifact / "rank-00" / "weights.safetensors")
    for rank in range(2):
        shard = load_file(out / f"rank-{rank:02d}" / "weights.safetensors")
        experts = [n for n in shard if ".moe.experts." in n]
        assert experts and {n for n in whole if ".moe.experts." in n} == set(experts)
        for name in experts:  # 4 experts over 2 ranks: rank r holds experts 2r and 2r + 1, whole
            assert torch.equal(shard[name], whole[name][2 * rank: 2 * rank + 2]), (family, rank, name)


def test_config_group_targets_pick_the_quantized_linears(tiny_mixtral, tmp_path, hf_logits, hf_encode):
    """An experts-only checkpoint (targets a regex over the experts): attention was left dense and stays so."""
    targets = ("re:.*block_sparse_moe[.]experts[.].*",)
    dequantized = _write_checkpoint(tiny_mixtral, "mixtral", tmp_path / "ckpt", tmp_path / "twin", targets)
    assert dequantized and all(".experts." in m for m in dequantized)
    out = tmp_path / "artifact"
    build(recipe_from_dict({"model": str(tmp_path / "ckpt"), "output": str(out), "dtype": "float32",
                            "target": {"device": "cpu"}, "quantization": {"method": "import"}}), show_progress=False)
    modules = json.loads((out / "manifest.json").read_text())["quant"]["modules"]
    assert modules["layers.0.attn.qkv"] == {"format": "dense"} and modules["layers.0.moe.experts.down"]["format"] == "w4a16"
    token_ids = hf_encode(tmp_path / "twin", PROMPTS[1]) + list(range(100, 120))
    torch.testing.assert_close(LLM(out, device="cpu").engine.score(token_ids), hf_logits(tmp_path / "twin", token_ids),
                               atol=1e-4, rtol=1e-4)
