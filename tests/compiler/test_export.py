"""`llmc export`: an artifact as a compressed-tensors checkpoint. Round trips through llmc's own importer (checked
elsewhere against float64 math and the published layouts), the written checkpoint against compressed-tensors'
format written out here from its definition, and the refusals."""

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from llmc.compiler.build import build
from llmc.compiler.export import export_artifact
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ArtifactError
from llmc.quant.formats import QuantizedWeight, make_format
from llmc.quant.importers import pack_gptq
from llmc.quant.rtn import rtn_quantize
from llmc.runtime.llm import LLM

TOKENS = list(range(5, 45))
HF_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _build(model, out, quant, device="cpu", dtype="float32", **extra):
    build(recipe_from_dict({"model": str(model), "output": str(out), "dtype": dtype, "target": {"device": device},
                            "quantization": quant, **extra}), show_progress=False)
    return out


def _scores(artifact):
    return LLM(artifact, device="cpu").engine.score(TOKENS)


def _modules(artifact):
    return json.loads((artifact / "manifest.json").read_text())["quant"]["modules"]


def _round_trip(original, tmp_path, device):
    """export → `quantization.method: import` build → the same formats and the same logits as the original."""
    exported = tmp_path / "exported"
    export_artifact(original, exported)
    reimported = _build(exported, tmp_path / "reimported", {"method": "import"}, device=device)
    ours, theirs = _modules(original), _modules(reimported)
    assert ours.keys() == theirs.keys()
    for name in ours:  # has_g_idx: llmc's importer drops a g_idx in plain order; is_per_channel: it imports fp8
        ignored = {"has_g_idx": None, "is_per_channel": None}  # per channel always (a per-tensor scale expands)
        assert {**ours[name], **ignored} == {**theirs[name], **ignored}, name
    torch.testing.assert_close(_scores(reimported), _scores(original), rtol=0, atol=0)
    return exported


CALIBRATION = {"num_samples": 4, "seq_len": 64}
ROUND_TRIPS = {
    "rtn-w4-sym-g32-gpu": ({"method": "rtn", "bits": 4, "group_size": 32}, "cuda"),
    "rtn-w4-asym-g32-gpu": ({"method": "rtn", "bits": 4, "group_size": 32, "symmetric": False}, "cuda"),
    "rtn-w4-asym-g64-plain": ({"method": "rtn", "bits": 4, "group_size": 64, "symmetric": False}, "cpu"),
    "rtn-w8-sym-channel": ({"method": "rtn", "bits": 8, "group_size": -1}, "cpu"),
    "rtn-w8-asym-g32": ({"method": "rtn", "bits": 8, "group_size": 32, "symmetric": False}, "cpu"),
    "gptq-w4-g32": ({"method": "gptq", "bits": 4, "group_size": 32, "calibration": CALIBRATION}, "cuda"),
    "gptq-w4-g32-act-order": ({"method": "gptq", "bits": 4, "group_size": 32, "act_order": True,
                               "calibration": CALIBRATION}, "cuda"),
    "fp8-dynamic": ({"method": "fp8", "activations": "dynamic"}, "cpu"),
    "fp8-static": ({"method": "fp8", "activations": "static", "calibration": CALIBRATION}, "cpu"),
    "fp8-per-tensor": ({"method": "fp8", "weights": "per_tensor"}, "cpu"),
}


# 2-3.5 s each: the default run keeps one of each method and layout (sym gpu, asym plain, act order, static FP8, w8)
SLOW_ROUND_TRIPS = ("rtn-w4-asym-g32-gpu", "rtn-w8-asym-g32", "gptq-w4-g32", "fp8-dynamic", "fp8-per-tensor")


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k in SLOW_ROUND_TRIPS else k
                                  for k in ROUND_TRIPS])
def test_round_trip_through_the_importer(kind, tiny_llama, tmp_path, data_dir):
    quant, device = ROUND_TRIPS[kind]
    if "calibration" in quant:
        quant = {**quant, "calibration": {**quant["calibration"], "data": str(data_dir / "wikitext2-valid-head.txt")}}
    original = _build(tiny_llama, tmp_path / "original", quant, device=device)
    exported = _round_trip(original, tmp_path, device)
    qc = json.loads((exported / "config.json").read_text())["quantization_config"]
    if kind == "fp8-per-tensor":
        assert qc["config_groups"]["group_0"]["weights"]["strategy"] == "tensor"
        with safe_open(exported / "model.safetensors", "pt") as f:
            assert f.get_slice("model.layers.0.self_attn.k_proj.weight_scale").get_shape() == [1]
    # llmc's GPTQ act order keeps static groups (quant/gptq.py): groups in plain order, so no weight_g_idx
    assert qc["config_groups"]["group_0"]["weights"].get("actorder") is None
    with safe_open(exported / "model.safetensors", "pt") as f:
        assert not [name for name in f.keys() if name.endswith("g_idx")]


@pytest.mark.parametrize("quant", [{"method": "rtn", "bits": 4, "group_size": 32, "symmetric": False},
                                   {"method": "fp8", "activations": "dynamic"}], ids=["rtn-w4-asym", "fp8-dynamic"])
def test_round_trip_of_a_quantized_lm_head(quant, tiny_llama, tmp_path):
    """An artifact whose lm_head is quantized (`ignore: []`) exports it packed, under lm_head, outside `ignore`,
    and the importer reads it back into the same head: the same logits, bit for bit."""
    original = _build(tiny_llama, tmp_path / "original", {**quant, "ignore": []})
    assert _modules(original)["lm_head"]["format"] != "dense"
    exported = _round_trip(original, tmp_path, "cpu")
    assert "lm_head" not in json.loads((exported / "config.json").read_text())["quantization_config"]["ignore"]
    with safe_open(exported / "model.safetensors", "pt") as f:
        head = {name for name in f.keys() if name.startswith("lm_head.")}
    assert head == ({"lm_head.weight", "lm_head.weight_scale"} if quant["method"] == "fp8" else
                    {"lm_head.weight_packed", "lm_head.weight_scale", "lm_head.weight_shape", "lm_head.weight_zero_point"})


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "phi3"])
def test_round_trip_of_other_families(family, request, tmp_path):
    """qwen2: q/k/v biases split with their rows; qwen3: the q/k norms renamed; phi3: q/k/v and gate/up written
    fused, under Phi-3's own names."""
    source = request.getfixturevalue(f"tiny_{family}")
    original = _build(source, tmp_path / "original", {"method": "rtn", "bits": 4, "group_size": 32}, device="cuda")
    exported = _round_trip(original, tmp_path, "cuda")
    names = load_file(exported / "model.safetensors").keys()
    if family == "qwen2":
        assert {f"model.layers.0.self_attn.{p}.bias" for p in ("q_proj", "k_proj", "v_proj")} <= names
    elif family == "phi3":
        layer = {n.removeprefix("model.layers.0.") for n in names if n.startswith("model.layers.0.")}
        assert layer == {f"{m}.{t}" for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                              "mlp.down_proj") for t in ("weight_packed", "weight_scale", "weight_shape")} \
            | {"input_layernorm.weight", "post_attention_layernorm.weight"}
    else:
        assert "model.layers.0.self_attn.q_norm.weight" in names


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_act_order_from_a_desc_act_gptq_checkpoint(device, tiny_llama, tmp_path):
    """Groups in a random column order (as GPTQ's desc_act). Built for cuda, the columns are permuted into the
    gpu layout (`perm` kept) and the export undoes that into weight_g_idx; built for cpu, g_idx is kept as is.
    Either way weight_g_idx is the checkpoint's g_idx, actorder "group", and the re-import is the same model."""
    source = tmp_path / "ckpt"
    shutil.copytree(tiny_llama, source)
    tensors = load_file(source / "model.safetensors")
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in HF_LINEARS]:
        weight = tensors.pop(name)
        order = torch.randperm(weight.shape[1], generator=torch.Generator().manual_seed(weight.shape[1]))
        q = rtn_quantize(weight[:, order], 4, 32, True, scale_dtype=torch.float16)
        levels, g_idx = torch.empty_like(q.qweight), torch.empty(weight.shape[1], dtype=torch.int32)
        levels[:, order], g_idx[order] = q.qweight, torch.arange(weight.shape[1], dtype=torch.int32) // 32
        packed = pack_gptq(QuantizedWeight(levels, q.scales, None, 4, 32, g_idx))
        tensors |= {f"{name[: -len('.weight')]}.{k}": v for k, v in packed.items()}
    save_file(tensors, source / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    qconfig = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": True}
    (source / "config.json").write_text(json.dumps({**config, "quantization_config": qconfig}))
    original = _build(source, tmp_path / "original", {"method": "import"}, device=device)
    assert _modules(original)["layers.0.attn.qkv"].get("layout", "plain") == ("gpu" if device == "cuda" else "plain")
    exported = _round_trip(original, tmp_path, device)
    qc = json.loads((exported / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["weights"]["actorder"] == "group"
    ours = load_file(exported / "model.safetensors")
    for name in ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"):
        want = tensors[f"{name}.g_idx"]
        if name.endswith("down_proj"):
            # the build put down's input columns in group order, gate_up's rows alike (shard.order_down_groups):
            # the same model, exported as it is, with down's groups now in plain order (still written: actorder
            # "group" gives every module a weight_g_idx)
            want = torch.arange(128, dtype=torch.int32) // 32
        assert ours[f"{name}.weight_g_idx"].dtype == torch.int32
        assert torch.equal(ours[f"{name}.weight_g_idx"], want), name
    artifact_weights = _artifact_weights(original)
    k_proj = {k.rsplit(".", 1)[1]: v for k, v in ours.items() if k.startswith("model.layers.0.self_attn.k_proj.")}
    torch.testing.assert_close(_dequantize_published(k_proj, 4, 32),
                               artifact_weights["layers.0.attn.qkv"][64:96].double(), rtol=0, atol=1e-6)


# --- the checkpoint against compressed-tensors' definition ------------------------------------------------------


def _unpack_int32(words, bits, dim, size):
    """compressed-tensors' pack_to_int32, read back: 32 // bits values per int32 word along `dim`, value k of
    a word at bits [bits*k, bits*(k+1)), least significant first, stored unsigned (signed + 2**(bits-1))."""
    words = words.to(torch.int64).movedim(dim, -1) % 2**32
    per_word = 32 // bits
    values = [(words >> (bits * k)) % 2**bits for k in range(per_word)]
    return torch.stack(values, -1).flatten(-2)[..., :size].movedim(-1, dim)


def _dequantize_published(t, bits, group_size):
    """w[o, i] = (q[o, i] - zp[o, g(i)]) * scale[o, g(i)], q and zp signed: q = stored - 2**(bits-1)."""
    out, in_ = t["weight_shape"].tolist()
    q = _unpack_int32(t["weight_packed"], bits, 1, in_) - 2 ** (bits - 1)
    zp = (_unpack_int32(t["weight_zero_point"], bits, 0, out) - 2 ** (bits - 1)) if "weight_zero_point" in t else 0
    g = t["weight_g_idx"].long() if "weight_g_idx" in t else (torch.arange(in_) // group_size if group_size > 0
                                                                 else torch.zeros(in_, dtype=torch.long))
    scale = t["weight_scale"].double()
    zp = zp[:, g] if torch.is_tensor(zp) else 0
    return (q.double() - zp) * scale[:, g]


def _artifact_weights(artifact):
    """The original artifact's dequantized weights, per runtime linear (its own format's dequantize)."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    tensors = load_file(artifact / "rank-00" / "weights.safetensors")
    out = {}
    for name, spec in manifest["quant"]["modules"].items():
        params = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
        fmt = make_format(spec, torch.float32)
        in_features = 128 if name.endswith("down") else 64
        out[name] = params["weight"].float() if spec["format"] == "dense" else fmt.dequantize(params, in_features)
    return out


@pytest.mark.parametrize("bits,group_size,symmetric,device", [(4, 32, False, "cuda"), (4, 32, True, "cpu"),
                                                              (8, -1, True, "cpu"), (8, 64, False, "cpu")])
def test_checkpoint_is_compressed_tensors_pack_quantized(bits, group_size, symmetric, device, tiny_llama, tmp_path):
    original = _build(tiny_llama, tmp_path / "original",
                      {"method": "rtn", "bits": bits, "group_size": group_size, "symmetric": symmetric}, device=device)
    exported = tmp_path / "exported"
    export_artifact(original, exported)
    config = json.loads((exported / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["quantization_status"] == "compressed"
    assert qc["ignore"] == ["lm_head"]
    (group,) = qc["config_groups"].values()
    assert group["targets"] == ["Linear"] and group["input_activations"] is None
    weights = group["weights"]
    assert {k: weights[k] for k in ("num_bits", "type", "symmetric", "strategy", "group_size", "actorder")} == {
        "num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": "group" if group_size > 0 else "channel",
        "group_size": group_size if group_size > 0 else None, "actorder": None}
    source_config = json.loads((tiny_llama / "config.json").read_text())
    for key in ("architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "intermediate_size", "vocab_size", "head_dim", "rms_norm_eps", "bos_token_id"):
        assert config[key] == source_config[key], key
    assert {p.name for p in exported.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                                     "tokenizer_config.json", "generation_config.json"}

    tensors = load_file(exported / "model.safetensors")
    ours = _artifact_weights(original)
    sizes = {"q_proj": 64, "k_proj": 32, "v_proj": 32, "o_proj": 64, "gate_proj": 128, "up_proj": 128, "down_proj": 64}
    fused = {"q_proj": ("attn.qkv", 0), "k_proj": ("attn.qkv", 64), "v_proj": ("attn.qkv", 96), "o_proj": ("attn.o", 0),
             "gate_proj": ("mlp.gate_up", 0), "up_proj": ("mlp.gate_up", 128), "down_proj": ("mlp.down", 0)}
    num_groups = lambda n: 1 if group_size == -1 else n // group_size  # noqa: E731
    for layer in range(2):
        for proj, out in sizes.items():
            kind = "self_attn" if proj.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            prefix = f"model.layers.{layer}.{kind}.{proj}"
            in_ = 128 if proj == "down_proj" else 64
            t = {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
            expected = {"weight_packed", "weight_scale", "weight_shape"} | (set() if symmetric else {"weight_zero_point"})
            assert set(t) == expected, prefix
            assert t["weight_packed"].dtype == torch.int32 and t["weight_packed"].shape == (out, in_ * bits // 32)
            assert t["weight_scale"].dtype == torch.float32 and t["weight_scale"].shape == (out, num_groups(in_))
            assert t["weight_shape"].dtype == torch.int64 and t["weight_shape"].tolist() == [out, in_]
            if not symmetric:
                assert t["weight_zero_point"].dtype == torch.int32
                assert t["weight_zero_point"].shape == (out * bits // 32, num_groups(in_))
            runtime, start = fused[proj]
            want = ours[f"layers.{layer}.{runtime}"][start:start + out].double()
            torch.testing.assert_close(_dequantize_published(t, bits, group_size), want, rtol=0, atol=1e-6)
    assert tensors["lm_head.weight"].dtype == torch.float32 and tensors["lm_head.weight"].shape == (4096, 64)
    assert "model.embed_tokens.weight" in tensors and "model.norm.weight" in tensors
    assert "model.layers.1.post_attention_layernorm.weight" in tensors


@pytest.mark.parametrize("activations", ["dynamic", "static"])
def test_checkpoint_is_compressed_tensors_float_quantized(activations, tiny_llama, tmp_path, data_dir):
    quant = {"method": "fp8", "activations": activations}
    if activations == "static":
        quant["calibration"] = {"data": str(data_dir / "wikitext2-valid-head.txt"), **CALIBRATION}
    original = _build(tiny_llama, tmp_path / "original", quant)
    exported = tmp_path / "exported"
    export_artifact(original, exported)
    qc = json.loads((exported / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "float-quantized" and qc["ignore"] == ["lm_head"]
    (group,) = qc["config_groups"].values()
    assert {k: group["weights"][k] for k in ("num_bits", "type", "strategy")} == {
        "num_bits": 8, "type": "float", "strategy": "channel"}
    inputs = group["input_activations"]
    assert (inputs["num_bits"], inputs["type"], inputs["dynamic"], inputs["strategy"]) == (
        (8, "float", True, "token") if activations == "dynamic" else (8, "float", False, "tensor"))
    tensors = load_file(exported / "model.safetensors")
    artifact = load_file(original / "rank-00" / "weights.safetensors")
    for proj, start, out in (("q_proj", 0, 64), ("k_proj", 64, 32), ("v_proj", 96, 32)):
        t = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.startswith(f"model.layers.1.self_attn.{proj}.")}
        assert set(t) == {"weight", "weight_scale"} | ({"input_scale"} if activations == "static" else set())
        assert t["weight"].dtype == torch.float8_e4m3fn and t["weight"].shape == (out, 64)
        assert t["weight_scale"].dtype == torch.float32 and t["weight_scale"].shape == (out, 1)
        want = (artifact["layers.1.attn.qkv.weight"].float() * artifact["layers.1.attn.qkv.weight_scale"])[start:start + out]
        torch.testing.assert_close(t["weight"].float() * t["weight_scale"], want, rtol=0, atol=0)
        if activations == "static":
            assert t["input_scale"].shape == (1,)
            assert torch.equal(t["input_scale"], artifact["layers.1.attn.qkv.input_scale"])


@pytest.mark.parametrize("family", ["llama", "phi3", "smollm3"])
def test_cli_export_and_dense_artifact(family, request, tmp_path, llmc_cli, hf_model):
    """An unquantized artifact exports as a plain checkpoint (no quantization_config): the source's tensors (Phi-3's
    fused ones as they were), and a config.json from which transformers builds the same model (its logits)."""
    source = request.getfixturevalue(f"tiny_{family}")
    original = _build(source, tmp_path / "original", {"method": "none"})
    code, err = llmc_cli("export", original, tmp_path / "exported")
    assert code == 0, err
    config = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert "quantization_config" not in config
    theirs, ours = load_file(source / "model.safetensors"), load_file(tmp_path / "exported" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k].float()) for k in ours)
    with torch.no_grad():
        ids = torch.tensor([TOKENS])
        torch.testing.assert_close(hf_model(tmp_path / "exported")(ids).logits, hf_model(source)(ids).logits,
                                   rtol=0, atol=0)


# --- refusals ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["parallel", "onnx", "3-bit", "mixed-schemes", "out-exists"])
def test_refusals_are_one_line(kind, tiny_llama, tmp_path, llmc_cli):
    """(Mixture-of-experts and KV-scale refusals: tests/compiler/test_export_moe.py.)"""
    rtn = {"method": "rtn", "bits": 4, "group_size": 32}
    out = tmp_path / "exported"
    if kind == "parallel":
        artifact, said = _build(tiny_llama, tmp_path / "a", rtn, parallel={"tensor": 2}), "parallel.tensor: 1"
    elif kind == "onnx":
        artifact, said = _build(tiny_llama, tmp_path / "a", {"method": "none"}, device="onnx-cpu"), "ONNX"
    elif kind == "3-bit":
        artifact, said = _build(tiny_llama, tmp_path / "a", {**rtn, "bits": 3}), "bits: 4 or 8"
    elif kind == "mixed-schemes":
        overrides = [{"match": "layers.1.*", "bits": 8}]
        artifact, said = _build(tiny_llama, tmp_path / "a", {**rtn, "overrides": overrides}), "without per-module overrides"
    else:
        artifact, said = _build(tiny_llama, tmp_path / "a", rtn), "not an empty folder"
        out.mkdir()
        (out / "keep").write_text("x")
    with pytest.raises(ArtifactError, match=said):
        export_artifact(artifact, out)
    code, err = llmc_cli("export", artifact, out)
    assert code != 0 and err.count("\n") == 1 and said in err
    assert kind == "out-exists" or not out.exists()
    assert not (tmp_path / "exported.tmp-export").exists()


@pytest.mark.parametrize("family", ["llama", "llama3_rope", "mistral", "qwen2", "qwen3", "phi3", "smollm3"])
def test_config_reads_back_to_the_same_model(family, request):
    """config.json is rebuilt from the manifest's ModelConfig alone: llmc's HF reader (what a re-import runs)
    reads it back to the same ModelConfig (rope scaling, sliding windows, eos ids included)."""
    from llmc.compiler.export import hf_config_of
    from llmc.compiler.hf_checkpoint import model_config_from_hf, model_spec_for, read_hf_config

    source = request.getfixturevalue(f"tiny_{family}")
    config = read_hf_config(source)
    spec = model_spec_for(config, source)
    model = model_config_from_hf(config, spec, "bfloat16")
    rebuilt = hf_config_of(model)
    assert model_config_from_hf(rebuilt, model_spec_for(rebuilt, source), "bfloat16") == model
    assert rebuilt["torch_dtype"] == "bfloat16" and rebuilt["model_type"] == config["model_type"]
