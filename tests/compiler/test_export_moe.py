"""`llmc export` of mixture-of-experts artifacts (one compressed-tensors module per expert, in the family's HF names)
and of FP8 KV-cache scales (kv_cache_scheme, per-layer self_attn.k_scale / v_scale). The oracles: the tiny
checkpoints transformers wrote (their tensor names and values, and transformers' logits of the export), and
llmc's importer, itself checked against the published layouts (test_export.py, test_moe_import.py): an export
imported back must be the same artifact, bit for bit."""

import json

import pytest
import torch
from safetensors.torch import load_file

from llmc.compiler.build import build
from llmc.compiler.export import export_artifact, hf_config_of
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ArtifactError
from llmc.runtime.llm import LLM

TOKENS = list(range(5, 45))
CALIBRATION = {"num_samples": 4, "seq_len": 64}
# suffixes of the tensors compressed-tensors writes per quantized module, by format
PACKED = {"weight_packed", "weight_scale", "weight_shape"}


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory, tiny_mixtral, tiny_qwen3_moe, hf_checkpoint_factory):
    """family → its tiny MoE checkpoint (OLMoE and Qwen2-MoE written here, once)."""
    root, made = tmp_path_factory.mktemp("export_moe"), {"mixtral": tiny_mixtral, "qwen3_moe": tiny_qwen3_moe}

    def get(family):
        if family not in made:
            made[family] = hf_checkpoint_factory(root / family, family)
        return made[family]

    return get


def _build(model, out, quant, device="cpu", **extra):
    build(recipe_from_dict({"model": str(model), "output": str(out), "dtype": "float32", "target": {"device": device},
                            "quantization": quant, **extra}), show_progress=False)
    return out


def _manifest(artifact):
    return json.loads((artifact / "manifest.json").read_text())


def _scores(artifact):
    return LLM(artifact, device="cpu").engine.score(TOKENS)


def _artifact_tensors(artifact):
    return load_file(artifact / "rank-00" / "weights.safetensors")


def _round_trip(original, tmp_path, device, **extra):
    """export → `method: import` build → the same formats, the same tensors and the same logits as the original."""
    exported = tmp_path / "exported"
    export_artifact(original, exported)
    reimported = _build(exported, tmp_path / "reimported", {"method": "import"}, device=device, **extra)
    ours, theirs = _manifest(original)["quant"]["modules"], _manifest(reimported)["quant"]["modules"]
    assert ours.keys() == theirs.keys()
    for name in ours:  # (the importer drops a g_idx in plain order, and reads fp8 per channel always)
        ignored = {"has_g_idx": None, "is_per_channel": None}
        assert {**ours[name], **ignored} == {**theirs[name], **ignored}, name
    a, b = _artifact_tensors(original), _artifact_tensors(reimported)
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        if name.endswith("weight_scale") and x.shape != y.shape:  # a per-tensor FP8 scale, imported per channel
            x = x.expand_as(y)
        assert x.dtype == y.dtype and torch.equal(x.contiguous().view(torch.uint8), y.view(torch.uint8)), name
    torch.testing.assert_close(_scores(reimported), _scores(original), rtol=0, atol=0)
    return exported


def _hf_modules(checkpoint) -> dict[str, torch.Tensor]:
    """The source checkpoint's linears (HF module → float weight) and its other tensors (name → tensor)."""
    return load_file(checkpoint / "model.safetensors")


def _check_layout(exported, source, quantized_suffixes: set[str]):
    """The export holds the source checkpoint's modules under the same names: every tensor that is not a quantized
    linear's weight as it was (embedding, norms, routers, shared expert gates, biases, a dense lm_head), every
    quantized linear (each expert's gate / up / down included) with compressed-tensors' tensors in place of its
    `.weight`; every router is dense and in `ignore`."""
    theirs, ours = _hf_modules(source), load_file(exported / "model.safetensors")
    qc = json.loads((exported / "config.json").read_text())["quantization_config"]
    ignored = set(qc["ignore"])
    their_modules = {n.rsplit(".", 1)[0] for n in theirs}
    assert {n.rsplit(".", 1)[0] for n in ours} == their_modules
    routers = {m for m in their_modules if m.endswith(("mlp.gate", "block_sparse_moe.gate", "shared_expert_gate"))}
    assert routers and routers <= ignored
    for name, tensor in theirs.items():
        module, param = name.rsplit(".", 1)
        if module in ignored or param != "weight" or tensor.dim() != 2 or module == "model.embed_tokens":
            assert torch.equal(ours[name], tensor), name
        else:
            written = {n.rsplit(".", 1)[1] for n in ours if n.rsplit(".", 1)[0] == module} - {"bias"}
            assert written == quantized_suffixes, module
    return qc


ROUND_TRIPS = {  # family, quantization, device, the tensors of a quantized module
    "mixtral-rtn-w4-g32-gpu": ("mixtral", {"method": "rtn", "bits": 4, "group_size": 32}, "cuda", PACKED),
    "qwen3_moe-fp8-dynamic": ("qwen3_moe", {"method": "fp8"}, "cpu", {"weight", "weight_scale"}),
    "qwen3_moe-fp8-block": ("qwen3_moe", {"method": "fp8", "weights": "block"}, "cpu", {"weight", "weight_scale"}),
    "qwen2_moe-rtn-w4-asym-g32": ("qwen2_moe", {"method": "rtn", "bits": 4, "group_size": 32, "symmetric": False}, "cpu",
                                  PACKED | {"weight_zero_point"}),
    "olmoe-rtn-w8-channel": ("olmoe", {"method": "rtn", "bits": 8, "group_size": -1}, "cpu", PACKED),
}
SLOW_ROUND_TRIPS = {
    "qwen3_moe-gptq-w4-g32": ("qwen3_moe", {"method": "gptq", "bits": 4, "group_size": 32, "calibration": CALIBRATION},
                              "cuda", PACKED),
    "mixtral-fp8-static": ("mixtral", {"method": "fp8", "activations": "static", "calibration": CALIBRATION}, "cpu",
                           {"weight", "weight_scale", "input_scale"}),
    "mixtral-fp8-per-tensor": ("mixtral", {"method": "fp8", "weights": "per_tensor"}, "cpu", {"weight", "weight_scale"}),
    "qwen2_moe-fp8-dynamic": ("qwen2_moe", {"method": "fp8"}, "cpu", {"weight", "weight_scale"}),
    "olmoe-rtn-w8-asym-g32": ("olmoe", {"method": "rtn", "bits": 8, "group_size": 32, "symmetric": False}, "cpu",
                              PACKED | {"weight_zero_point"}),
}


@pytest.mark.parametrize("kind", list(ROUND_TRIPS) + [pytest.param(k, marks=pytest.mark.slow) for k in SLOW_ROUND_TRIPS])
def test_moe_round_trip(kind, moe_checkpoint, tmp_path, data_dir):
    family, quant, device, suffixes = {**ROUND_TRIPS, **SLOW_ROUND_TRIPS}[kind]
    if "calibration" in quant:
        quant = {**quant, "calibration": {**quant["calibration"], "data": str(data_dir / "wikitext2-valid-head.txt")}}
    source = moe_checkpoint(family)
    original = _build(source, tmp_path / "original", quant, device=device)
    exported = _round_trip(original, tmp_path, device)
    qc = _check_layout(exported, source, suffixes)
    (group,) = qc["config_groups"].values()
    assert group["targets"] == ["Linear"] and qc["kv_cache_scheme"] is None
    if quant["method"] == "fp8" and quant.get("weights") == "block":
        assert group["weights"]["strategy"] == "block"
        shapes = load_file(exported / "model.safetensors")
        # an expert's gate_up (64 + 64 rows) is one block of 128 rows in the artifact: each module gets its own row
        assert shapes["model.layers.0.mlp.experts.3.up_proj.weight_scale"].shape == (1, 1)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe"])
def test_unquantized_moe_export_is_the_checkpoint(family, moe_checkpoint, tmp_path, hf_model):
    """An unquantized MoE artifact exports as the family's own checkpoint: the source's tensor names and values, and
    a config.json from which transformers builds the same model (the same logits) and llmc reads the same
    ModelConfig."""
    from llmc.compiler.hf_checkpoint import model_config_from_hf, model_spec_for, read_hf_config

    source = moe_checkpoint(family)
    original = _build(source, tmp_path / "original", {"method": "none"})
    export_artifact(original, tmp_path / "exported")
    theirs, ours = load_file(source / "model.safetensors"), load_file(tmp_path / "exported" / "model.safetensors")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    config = read_hf_config(tmp_path / "exported")
    assert "quantization_config" not in config
    model = _manifest(original)["model"]
    assert model_config_from_hf(config, model_spec_for(config, source), "float32").__dict__ == model
    with torch.no_grad():
        ids = torch.tensor([TOKENS])
        torch.testing.assert_close(hf_model(tmp_path / "exported")(ids).logits, hf_model(source)(ids).logits,
                                   rtol=0, atol=0)


# --- FP8 KV-cache scales -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family,quant", [
    pytest.param("llama", {"method": "rtn", "bits": 4, "group_size": 32}, id="llama-rtn-w4"),
    pytest.param("qwen3_moe", {"method": "fp8"}, id="qwen3_moe-fp8", marks=pytest.mark.slow),  # (2.4 s; the MoE round trips
])                                                                                            #  above cover its experts)
def test_kv_scales_round_trip(family, quant, request, tmp_path, data_dir):
    """A build's calibrated FP8 KV scales are written as compressed-tensors' kv_cache_scheme with each layer's
    self_attn.k_scale / v_scale (float32 [1]); imported back they are the artifact's (rounded to float32, as the
    checkpoint stores them) and give the same logits with an FP8 cache."""
    source = request.getfixturevalue(f"tiny_{family}")
    calibration = {"data": str(data_dir / "wikitext2-valid-head.txt"), **CALIBRATION}
    kv = {"runtime": {"kv_cache_dtype": "fp8"}}
    original = _build(source, tmp_path / "original", {**quant, "calibration": calibration}, **kv)
    scales = _manifest(original)["kv"]
    assert scales["scales_source"] == "calibration"
    exported = _round_trip(original, tmp_path, "cpu", **kv)
    qc = json.loads((exported / "config.json").read_text())["quantization_config"]
    assert qc["kv_cache_scheme"] == {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                                     "group_size": None, "strategy": "tensor", "block_structure": None,
                                     "actorder": None, "observer": "minmax", "observer_kwargs": {}}
    tensors = load_file(exported / "model.safetensors")
    for i in range(scales["num_layers"]):
        for kind in ("k", "v"):
            t = tensors[f"model.layers.{i}.self_attn.{kind}_scale"]
            assert t.dtype == torch.float32 and t.shape == (1,)
            assert t.item() == torch.tensor(scales[f"{kind}_scales"][i], dtype=torch.float32).item()
    back = _manifest(tmp_path / "reimported")["kv"]
    assert back["scales_source"] == "checkpoint" and back["dtype"] == "float8_e4m3fn"
    for kind in ("k", "v"):
        assert back[f"{kind}_scales"] == [torch.tensor(s, dtype=torch.float32).item() for s in scales[f"{kind}_scales"]]


def test_e5m2_kv_scales_are_written_as_e4m3_s(tiny_llama, tmp_path, data_dir):
    """kv_cache_scheme's float 8 is e4m3: scales a build calibrated for e5m2 (amax / 57344) are written as amax / 448."""
    calibration = {"data": str(data_dir / "wikitext2-valid-head.txt"), **CALIBRATION}
    original = _build(tiny_llama, tmp_path / "original", {"method": "rtn", "bits": 8, "group_size": -1,
                                                         "calibration": calibration},
                      runtime={"kv_cache_dtype": "fp8_e5m2"})
    scales = _manifest(original)["kv"]
    export_artifact(original, tmp_path / "exported")
    tensors = load_file(tmp_path / "exported" / "model.safetensors")
    for i in range(scales["num_layers"]):
        amax = scales["k_scales"][i] * 57344.0
        assert tensors[f"model.layers.{i}.self_attn.k_scale"].item() == pytest.approx(amax / 448.0, rel=1e-6)


# --- what stays refused --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["granitemoe", "dense-kv-scales", "fp8-block-split-rows"])
def test_refusals_are_one_line(kind, tiny_llama, tiny_mixtral, hf_checkpoint_factory, tmp_path, data_dir, llmc_cli,
                               capsys):
    out = tmp_path / "exported"
    if kind == "granitemoe":
        source = hf_checkpoint_factory(tmp_path / "granitemoe", "granitemoe")
        artifact, said = _build(source, tmp_path / "a", {"method": "rtn", "bits": 4, "group_size": 32}), "input_linear"
    elif kind == "dense-kv-scales":
        calibration = {"data": str(data_dir / "wikitext2-valid-head.txt"), **CALIBRATION}
        artifact = _build(tiny_llama, tmp_path / "a", {"method": "none", "calibration": calibration},
                          runtime={"kv_cache_dtype": "fp8"})
        said = "FP8 KV-cache scales"
    else:  # Mixtral's experts are 96 wide: an expert's up rows start inside the gate_up's first block of 128
        artifact, said = _build(tiny_mixtral, tmp_path / "a", {"method": "fp8", "weights": "block"}), "w3: the rows"
    with pytest.raises(ArtifactError, match=said):
        export_artifact(artifact, out)
    capsys.readouterr()  # (what writing the checkpoint printed)
    code, err = llmc_cli("export", artifact, out)
    assert code != 0 and err.count("\n") == 1 and said in err
    assert not out.exists() and not (tmp_path / "exported.tmp-export").exists()


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe"])
def test_moe_config_reads_back_to_the_same_model(family, moe_checkpoint):
    """config.json's MoE keys (experts, top-k, widths, the sparse layers, the shared expert) read back to the same
    ModelConfig."""
    from llmc.compiler.hf_checkpoint import model_config_from_hf, model_spec_for, read_hf_config

    source = moe_checkpoint(family)
    config = read_hf_config(source)
    model = model_config_from_hf(config, model_spec_for(config, source), "bfloat16")
    rebuilt = hf_config_of(model)
    assert model_config_from_hf(rebuilt, model_spec_for(rebuilt, source), "bfloat16") == model
