"""Quantized builds end to end: imports against transformers running the dequantized weights, the
algorithms through the layer-by-layer pipeline, and the up-front errors."""

import json
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import CheckpointError, RecipeError
from llmc.quant.importers import pack_awq_gemm, pack_gptq, pack_pack_quantized
from llmc.quant.formats import QuantizedWeight
from llmc.quant.reference import dequantize_weight
from llmc.quant.rtn import rtn_quantize
from llmc.runtime.llm import LLM

# (Phi-3's checkpoints store q/k/v as one qkv_proj and gate/up as one gate_up_proj: quantized and packed whole)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
FORMATS = {
    "awq": (lambda q: pack_awq_gemm(q), False, {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}),
    "gptq-sym": (lambda q: pack_gptq(q, is_v1=True), True, {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}),
    "gptq-asym": (lambda q: pack_gptq(q, is_v1=True), False, {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, "desc_act": False}),
    "compressed-tensors": (lambda q: pack_pack_quantized(q), True, {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}}),
}


def _quantized_checkpoint(source, dest, kind):
    """A checkpoint in a published layout, made from `source` by RTN; returns the dequantized weights."""
    pack, symmetric, qconfig = FORMATS[kind]
    shutil.copytree(source, dest)
    tensors = load_file(dest / "model.safetensors")
    dequantized = {}
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in LINEARS]:
        # Scales rounded to the layout's storage dtype, so the dequantized oracle is exactly what is stored.
        scale_dtype = torch.bfloat16 if kind == "compressed-tensors" else torch.float16
        q = rtn_quantize(tensors.pop(name), 4, 32, symmetric, scale_dtype=scale_dtype)
        module = name[: -len(".weight")]
        tensors |= {f"{module}.{k}": v for k, v in pack(q).items()}
        dequantized[name] = dequantize_weight(q)
    save_file(tensors, dest / "model.safetensors")
    config = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "quantization_config": qconfig}))
    return dequantized


@pytest.mark.parametrize("family", ["llama", "phi3"])
@pytest.mark.parametrize("kind", list(FORMATS))
def test_import_matches_transformers_on_the_dequantized_weights(kind, family, request, tmp_path, hf_model, hf_encode):
    source = request.getfixturevalue(f"tiny_{family}")
    dequantized = _quantized_checkpoint(source, tmp_path / "ckpt", kind)
    out = tmp_path / "artifact"
    build(recipe_from_dict({"model": str(tmp_path / "ckpt"), "output": str(out), "dtype": "float32",
                            "quantization": {"method": "import"}}), show_progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["quant"]["modules"]["layers.0.attn.qkv"]["format"] == "w4a16"
    # The oracle: transformers' own model with each linear replaced by the dequantized weights.
    oracle = hf_model(source)
    state = {k: v.clone() for k, v in oracle.state_dict().items()}
    with torch.no_grad():
        for name, weight in dequantized.items():
            oracle.get_parameter(name).copy_(weight)
        token_ids = hf_encode(source, "The quick brown fox") + list(range(50, 80))
        expected = oracle(torch.tensor([token_ids])).logits[0]
        oracle.load_state_dict(state)
    ours = LLM(out, device="cpu").engine.score(token_ids)
    torch.testing.assert_close(ours, expected, atol=2e-4, rtol=2e-4)


def test_import_with_mismatched_config_is_one_line(tiny_llama, tmp_path):
    _quantized_checkpoint(tiny_llama, tmp_path / "ckpt", "gptq-sym")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["quantization_config"]["group_size"] = 64  # tensors were written with 32
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="has shape .* expected .* check quantization_config"):
        build(recipe_from_dict({"model": str(tmp_path / "ckpt"), "output": str(tmp_path / "o"),
                                "quantization": {"method": "import"}}), show_progress=False)
    assert not (tmp_path / "o").exists()


def test_import_of_an_unquantized_checkpoint_is_refused(tiny_llama, tmp_path):
    with pytest.raises(CheckpointError, match="no quantization_config"):
        build(recipe_from_dict({"model": str(tiny_llama), "output": str(tmp_path / "o"),
                                "quantization": {"method": "import"}}), show_progress=False)


def test_peer_checkpoint_imports_with_its_own_tensors(peer_checkpoint_dir, tmp_path):
    peer = peer_checkpoint_dir
    out = tmp_path / "peer"
    build(recipe_from_dict({"model": str(peer), "output": str(out), "quantization": {"method": "import"}}), show_progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    # target.device defaults to cuda: 4-bit weights are repacked into the Triton kernel's layout.
    assert manifest["quant"]["modules"]["layers.0.mlp.down"] == {
        "format": "w4a16", "bits": 4, "group_size": 128, "symmetric": True, "has_g_idx": False, "layout": "gpu"}
    assert manifest["quant"]["modules"]["lm_head"] == {"format": "dense"}
    llm = LLM(out, device="cpu")
    text = llm.generate("ROMEO:", __import__("llmc").SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    assert text.startswith("\n")  # a speaker turn follows the name, as the unquantized model does


def test_gpu_layout_and_plain_layout_compute_the_same_model(peer_checkpoint_dir, tmp_path):
    peer = peer_checkpoint_dir
    engines = {}
    for device in ("cuda", "cpu"):
        out = tmp_path / device
        build(recipe_from_dict({"model": str(peer), "output": str(out), "quantization": {"method": "import"},
                                "target": {"device": device}}), show_progress=False)
        modules = json.loads((out / "manifest.json").read_text())["quant"]["modules"]
        assert modules["layers.1.attn.qkv"].get("layout", "plain") == ("gpu" if device == "cuda" else "plain")
        engines[device] = LLM(out, device="cpu").engine
        # the gpu layout's gate_up rows are interleaved on load (its GEMV makes SiLU · mul): compared here too
        mlps = [layer.mlp for layer in engines[device].runner.model.layers.values()]
        assert all(mlp.is_gate_up_interleaved == (device == "cuda") for mlp in mlps)
    token_ids = list(range(5, 69))
    torch.testing.assert_close(engines["cuda"].score(token_ids), engines["cpu"].score(token_ids), rtol=1e-5, atol=1e-5)


def _calibrated(tmp_path, ref_model_dir, data_dir, **quant):
    out = tmp_path / quant["method"]
    calibration = {"data": str(data_dir / "wikitext2-valid-head.txt"), "num_samples": 16, "seq_len": 128}
    build(recipe_from_dict({"model": str(ref_model_dir), "output": str(out),
                            "quantization": {**quant, "calibration": calibration}}), show_progress=False)
    return json.loads((out / "manifest.json").read_text())["quant"]["report"]


# AWQ: a 37 s build on 2 cores (its model tail re-runs later layers per variant); slow
@pytest.mark.parametrize("method", ["gptq", pytest.param("awq", marks=pytest.mark.slow)])
def test_calibrated_methods_beat_rtn_on_held_out_text(method, tmp_path, ref_model_dir, data_dir):
    settings = {"bits": 3, "group_size": 128, "symmetric": method == "gptq"}
    ours = _calibrated(tmp_path, ref_model_dir, data_dir, method=method, **settings)
    rtn = _calibrated(tmp_path, ref_model_dir, data_dir, method="rtn", **settings)
    assert ours["perplexity_unquantized"] == rtn["perplexity_unquantized"]
    # KL to the float model: on 4 short held-out windows perplexity itself is too noisy to rank by.
    assert ours["mean_kl_divergence"] < rtn["mean_kl_divergence"]
    assert ours["top1_agreement"] > rtn["top1_agreement"]


def test_fp8_static_records_input_scales(tmp_path, ref_model_dir, data_dir):
    report = _calibrated(tmp_path, ref_model_dir, data_dir, method="fp8", activations="static")
    from llmc.runtime.artifact import read_safetensors_header

    header = read_safetensors_header(tmp_path / "fp8" / "rank-00" / "weights.safetensors")
    assert header["layers.0.attn.qkv.input_scale"]["shape"] == [1]
    assert header["layers.0.attn.qkv.weight"]["dtype"] == "F8_E4M3"
    assert report["perplexity_quantized"] < report["perplexity_unquantized"] * 1.02


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("checkpoint", ["tiny_llama", "tiny_qwen3_moe"])
def test_fp8_linears_take_their_input_quantized_by_the_kernel_before(checkpoint, device, request, tmp_path):
    """A w8a8-fp8 qkv, gate_up or down takes its activations quantized per token by the RMSNorm or
    SiLU · mul that makes them (on CUDA one kernel instead of two), except after an MoE layer's norm,
    whose router needs the norm's output; static input scales keep their own quantization. The model
    computes exactly what it computes when each linear quantizes its own input."""
    source = request.getfixturevalue(checkpoint)
    engines = {}
    for activations in ("dynamic", "static"):
        quant = {"method": "fp8", "activations": activations}
        if activations == "static":
            data = request.getfixturevalue("data_dir") / "wikitext2-valid-head.txt"
            quant["calibration"] = {"data": str(data), "num_samples": 2, "seq_len": 32}
        build(recipe_from_dict({"model": str(source), "output": str(tmp_path / activations), "quantization": quant,
                                "dtype": "bfloat16", "target": {"device": device}}), show_progress=False)
        engines[activations] = LLM(tmp_path / activations, device=device, max_model_len=128, num_kv_blocks=64).engine
    layers = list(engines["dynamic"].runner.model.layers.values())
    assert any(layer.is_moe for layer in layers) == (checkpoint == "tiny_qwen3_moe")
    for layer in layers:
        assert layer.input_norm.fp8_output and layer.post_attn_norm.fp8_output == (not layer.is_moe)
        assert layer.is_moe or layer.mlp.fp8_down_input
    for layer in engines["static"].runner.model.layers.values():
        assert not (layer.input_norm.fp8_output or layer.post_attn_norm.fp8_output)
        assert layer.is_moe or not layer.mlp.fp8_down_input
    token_ids = list(range(5, 69))
    fused = engines["dynamic"].score(token_ids)
    for layer in layers:
        layer.input_norm.fp8_output = layer.post_attn_norm.fp8_output = False
        if not layer.is_moe:
            layer.mlp.fp8_down_input = False
    assert torch.equal(fused, engines["dynamic"].score(token_ids))


@pytest.mark.parametrize(
    ("quant", "words"),
    [
        ({"method": "gptq", "calibration": {"data": "tests/conftest.py", "num_samples": 64, "seq_len": 512}}, ["tokens", "num_samples (64)"]),
        ({"method": "rtn", "group_size": 32, "overrides": [{"match": "*down*", "group_size": 128}]}, None),
        ({"method": "rtn", "ignore": ["q_proj"]}, ["fused into layers.0.attn.qkv", "all of them or none"]),
    ],
)
def test_bad_quantization_settings_fail_before_heavy_work(quant, words, tmp_path, ref_model_dir, monkeypatch, repo_root):
    monkeypatch.chdir(repo_root)
    recipe = recipe_from_dict({"model": str(ref_model_dir), "output": str(tmp_path / "o"), "quantization": quant})
    if words is None:  # 128 divides down's 1024 inputs: this one must build
        build(recipe, show_progress=False)
        return
    with pytest.raises(RecipeError) as err:
        build(recipe, show_progress=False)
    for word in words:
        assert word in str(err.value)
    assert not (tmp_path / "o").exists()


def test_group_size_that_does_not_divide_is_refused(tiny_qwen3, tmp_path):
    """The line names the linear and the override that would build it (as GLM-4.5-Air's dense layer needs: its
    10944 MLP width is no multiple of 128): with each suggested override added, the build goes through."""
    quantization = {"method": "rtn", "group_size": 128, "overrides": []}
    for _ in range(8):
        try:
            build(recipe_from_dict({"model": str(tiny_qwen3), "output": str(tmp_path / "o"),
                                    "quantization": quantization}), show_progress=False)
            break
        except RecipeError as e:
            found = re.fullmatch(r'quantization.group_size: 128 does not divide (\S+)\'s (\d+) input features; .*'
                                 r'quantization.overrides: \[\{match: "(\S+)", group_size: (-?\d+)\}\]', str(e))
            assert found and found[1] == found[3], str(e)
            assert int(found[2]) % 128 and (found[4] == "-1" or int(found[2]) % int(found[4]) == 0)
            quantization["overrides"].append({"match": found[3], "group_size": int(found[4])})
    else:
        raise AssertionError("the suggested overrides did not let the build through")
    assert quantization["overrides"]  # the global 128 was refused at least once


def test_an_override_group_size_that_does_not_divide_names_the_override(tiny_llama, tmp_path):
    """The line named quantization.group_size (32 here, which divides) when the override's 128 did not."""
    with pytest.raises(RecipeError, match=r"^quantization.overrides\[1\].group_size: 128 does not divide layers.0.attn.qkv"):
        build(recipe_from_dict({"model": str(tiny_llama), "output": str(tmp_path / "o"), "quantization": {
            "method": "rtn", "group_size": 32, "overrides": [{"match": "layers.1.*", "bits": 8},
                                                             {"match": "layers.0.*", "group_size": 128}]}}),
              show_progress=False)


@pytest.mark.parametrize("bits,device,is_said", [(8, "cuda", True), (3, "cuda", True), (4, "cuda", False), (8, "cpu", False)])
def test_build_says_which_linears_run_dequantized_on_cuda(bits, device, is_said, tiny_llama, tmp_path, caplog):
    """w8a16 / w3a16 have no GPU kernel: a cuda build says so in one line; 4-bit weights (the W4A16
    kernels) and CPU targets do not."""
    with caplog.at_level("WARNING", logger="llmc"):
        build(recipe_from_dict({"model": str(tiny_llama), "output": str(tmp_path / "o"), "target": {"device": device},
                                "quantization": {"method": "rtn", "bits": bits, "group_size": 32}}), show_progress=False)
    said = [r.getMessage() for r in caplog.records if "no GPU kernel" in r.getMessage()]
    assert len(said) == int(is_said) and "\n" not in "".join(said)
    if is_said:
        assert f"w{bits}a16" in said[0] and "dequantized" in said[0]


def _act_order_rtn(weight, group_size):
    """4-bit RTN whose groups follow a random column order, stored as GPTQ's desc_act leaves them
    (g_idx[i] = the group of column i). The order depends only on in_features, so linears that share
    an input (q/k/v, gate/up) share it, as GPTQ's act order (one Hessian per input) makes them."""
    in_features = weight.shape[1]
    order = torch.randperm(in_features, generator=torch.Generator().manual_seed(in_features))
    q = rtn_quantize(weight[:, order], 4, group_size, True, scale_dtype=torch.float16)
    levels = torch.empty_like(q.qweight)
    levels[:, order] = q.qweight
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[order] = torch.arange(in_features, dtype=torch.int32) // group_size
    return QuantizedWeight(levels, q.scales, None, 4, group_size, g_idx)


def write_act_order_gptq(original, source) -> dict:
    """A copy of checkpoint `original` at `source` whose linears are desc_act GPTQ (4-bit, group 32, act order
    by column norm, packed as GPTQ v1 with g_idx, config.json's quantization_config saying so); returns the
    dequantized weights by tensor name."""
    shutil.copytree(original, source)
    tensors, dequantized = load_file(source / "model.safetensors"), {}
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in LINEARS]:
        q = _act_order_rtn(tensors.pop(name), 32)
        tensors |= {f"{name[: -len('.weight')]}.{k}": v for k, v in pack_gptq(q, is_v1=True).items()}
        dequantized[name] = dequantize_weight(q)
    save_file(tensors, source / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    qconfig = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": True}
    (source / "config.json").write_text(json.dumps({**config, "quantization_config": qconfig}))
    return dequantized


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_act_order_gptq_import_runs_on_the_w4a16_layout(family, request, tmp_path, hf_model):
    """A desc_act GPTQ checkpoint: a cuda build packs its act-order linears for the W4A16 kernels (the
    columns permuted into contiguous groups, `perm` kept), a cpu build keeps g_idx; both compute the
    model transformers computes on the dequantized weights (Phi-3: its fused gate_up_proj's rows, both
    halves, reordered with down's groups)."""
    original, source = request.getfixturevalue(f"tiny_{family}"), tmp_path / "ckpt"
    dequantized = write_act_order_gptq(original, source)
    scores = {}
    for device in ("cuda", "cpu"):
        build(recipe_from_dict({"model": str(source), "output": str(tmp_path / device), "quantization": {"method": "import"},
                                "target": {"device": device}}), show_progress=False)
        modules = json.loads((tmp_path / device / "manifest.json").read_text())["quant"]["modules"]
        assert modules["layers.0.attn.qkv"]["has_g_idx"]
        assert modules["layers.0.attn.qkv"].get("layout", "plain") == ("gpu" if device == "cuda" else "plain")
        llm = LLM(tmp_path / device, device="cpu")
        scores[device] = llm.engine.score(list(range(5, 69)))
        if device == "cuda":  # down's groups were put in order at build time (gate_up's rows alike): no gather
            with safe_open(tmp_path / device / "rank-00" / "weights.safetensors", "pt") as f:
                perm = f.get_tensor("layers.0.mlp.down.perm")
            assert torch.equal(perm, torch.arange(perm.numel(), dtype=perm.dtype))
            layer = llm.engine.runner.model.layers["0"]
            assert "perm" not in layer.mlp.down.param_names
            # qkv's and gate_up's gathers are done by the norms that feed them
            for norm, linear in ((layer.input_norm, layer.attn.qkv), (layer.post_attn_norm, layer.mlp.gate_up)):
                assert "perm" not in linear.params() and torch.equal(norm.out_perm, linear.perm)
                assert not torch.equal(norm.out_perm, torch.arange(norm.out_perm.numel(), dtype=norm.out_perm.dtype))
    # float32 sums over the input columns in another order (the gpu layout's, x permuted by the norms)
    torch.testing.assert_close(scores["cuda"], scores["cpu"], rtol=1e-4, atol=1e-4)
    oracle = hf_model(original)
    state = {k: v.clone() for k, v in oracle.state_dict().items()}
    with torch.no_grad():
        for name, weight in dequantized.items():
            oracle.get_parameter(name).copy_(weight)
        expected = oracle(torch.tensor([list(range(5, 69))])).logits[0]
        oracle.load_state_dict(state)
    torch.testing.assert_close(scores["cpu"], expected, rtol=2e-4, atol=2e-4)
