"""The onnx-cpu target end to end: the ONNX artifact against transformers (float32, unquantized) for
every family, and against the torch runtime on the same quantized build (its levels, its greedy
tokens, its perplexity)."""

import json
import sys

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from onnx import numpy_helper
from safetensors.torch import load_file

from llmc.cli import cli
from llmc.compiler.build import build
from llmc.compiler.onnx_linears import unpack_nbits
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ConfigError, RecipeError
from llmc.quant.packing import unpack_words
from llmc.runtime import artifact as art
from llmc.runtime import onnx_runner
from llmc.runtime.llm import LLM
from llmc.runtime.options import resolve_options
from llmc.runtime.sampling_params import SamplingParams

PROMPTS = [
    "ROMEO:",
    "The quick brown fox jumps over the lazy dog, and then",
    "In the beginning",
    "What light through yonder window breaks? It is the east",
    "A",
]
NUM_NEW_TOKENS = 32


def _build(model, out, target="onnx-cpu", quantization=None, max_model_len=256, target_extra=None, **extra):
    recipe = {"model": str(model), "output": str(out), "dtype": "float32", "runtime": {"max_model_len": max_model_len},
              "target": {"device": target, **(target_extra or {})}, **extra}
    if quantization:
        recipe["quantization"] = {"report": False, **quantization}
    build(recipe_from_dict(recipe), show_progress=False)
    return out


@pytest.fixture(scope="module")
def onnx_artifact(tmp_path_factory):
    cache = {}

    def get(checkpoint):
        if checkpoint not in cache:
            cache[checkpoint] = _build(checkpoint, tmp_path_factory.mktemp("onnx") / "a")
        return cache[checkpoint]

    return get


def _greedy(llm, prompt_ids, num_tokens=NUM_NEW_TOKENS):
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids],
                           SamplingParams(temperature=0, max_tokens=num_tokens))
    return [o.outputs[0].token_ids for o in outputs]


def _check_against_transformers(artifact, checkpoint, hf_greedy, hf_logits, hf_encode, label):
    expected = hf_greedy(checkpoint, PROMPTS, NUM_NEW_TOKENS)
    # Fewer slots than prompts and a small token budget: sequences join as others finish, long
    # prompts are prefilled in chunks beside running decodes.
    llm = LLM(artifact, device="cpu", max_num_seqs=3, max_num_batched_tokens=16)
    assert _greedy(llm, [hf_encode(checkpoint, p) for p in PROMPTS]) == expected, label
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]
    token_ids = hf_encode(checkpoint, PROMPTS[3]) + list(range(100, 140))
    torch.testing.assert_close(llm.engine.score(token_ids), hf_logits(checkpoint, token_ids),
                               atol=1e-4, rtol=1e-4, msg=label)


def test_every_family_matches_transformers(tiny_checkpoint, onnx_artifact, hf_greedy, hf_logits, hf_encode):
    family, checkpoint = tiny_checkpoint
    artifact = onnx_artifact(checkpoint)
    _check_against_transformers(artifact, checkpoint, hf_greedy, hf_logits, hf_encode, family)
    onnx.checker.check_model(str(artifact / "onnx" / "model.onnx"))
    manifest = art.read_manifest(artifact)
    assert not (artifact / "rank-00").exists() and art.verify_files(artifact, manifest) == []
    assert manifest.target["onnx"]["op_counts"]["GroupQueryAttention"] == manifest.model.num_layers
    # q, k, v go to GroupQueryAttention packed (gate/up's Split only) unless per-head q/k norms sit in between
    assert manifest.target["onnx"]["op_counts"]["Split"] == manifest.model.num_layers * (2 if manifest.model.qk_norm else 1)
    # the graph's past K/V inputs are float32 whatever the weights' dtype, and the manifest says so
    graph = onnx.load(str(artifact / "onnx" / "model.onnx"), load_external_data=False).graph
    past = [i for i in graph.input if i.name.startswith(("past_key.", "past_value."))]
    assert past and all(i.type.tensor_type.elem_type == onnx.TensorProto.FLOAT for i in past)
    assert manifest.kv.dtype == "float32"


def test_ref_llama_matches_transformers(ref_model_dir, onnx_artifact, hf_greedy, hf_logits, hf_encode, monkeypatch):
    # two cached io bindings: slot ranges and chunk shapes keep evicting each other's bindings
    monkeypatch.setattr(onnx_runner, "MAX_CACHED_BINDINGS", 2)
    _check_against_transformers(onnx_artifact(ref_model_dir), ref_model_dir, hf_greedy, hf_logits, hf_encode, "ref")


def test_sliding_window_matches_transformers(hf_checkpoint_factory, tmp_path, hf_logits, hf_encode):
    checkpoint = hf_checkpoint_factory(tmp_path / "ckpt", "mistral", sliding_window=8)
    llm = LLM(_build(checkpoint, tmp_path / "a"), device="cpu", max_num_batched_tokens=5)
    token_ids = hf_encode(checkpoint, PROMPTS[1]) + list(range(100, 120))
    torch.testing.assert_close(llm.engine.score(token_ids), hf_logits(checkpoint, token_ids), atol=1e-4, rtol=1e-4)


# ---- quantized builds: the ONNX graph against the torch runtime on the same levels ---------------


def _nbits_nodes(artifact):
    model = onnx.load(str(artifact / "onnx" / "model.onnx"), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}
    tensor = lambda name: numpy_helper.to_array(inits[name], base_dir=str(artifact / "onnx"))  # noqa: E731
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            attrs = {a.name: a.i for a in node.attribute}
            names = [*node.input[1:4], ""][:3]  # B, scales, zero_points (absent when symmetric)
            yield node.input[1].rsplit(".", 1)[0], attrs, [tensor(n) if n else None for n in names]


def _check_levels(torch_artifact, onnx_artifact):
    """Every MatMulNBits holds exactly the torch artifact's (the quantizer's) levels, scales and zeros."""
    weights = load_file(torch_artifact / "rank-00" / "weights.safetensors")
    manifest = art.read_manifest(onnx_artifact)
    quantized = {m for m, spec in manifest.quant.modules.items() if spec["format"] == "w4a16"}
    seen = set()
    for module, attrs, (packed, scales, zero_points) in _nbits_nodes(onnx_artifact):
        spec, k, n = manifest.quant.modules[module], attrs["K"], attrs["N"]
        num_groups = 1 if spec["group_size"] == -1 else k // spec["group_size"]
        repeat = (k // attrs["block_size"]) // num_groups
        assert attrs["bits"] == 4 and packed.dtype == np.uint8 and packed.shape == (n, k // attrs["block_size"], attrs["block_size"] // 2)
        levels = unpack_words(weights[f"{module}.qweight"], 4, dim=1, size=k).numpy()
        np.testing.assert_array_equal(unpack_nbits(packed, 4, k), levels, err_msg=module)
        np.testing.assert_array_equal(scales, np.repeat(weights[f"{module}.scales"].float().numpy(), repeat, 1))
        if spec["symmetric"]:
            assert zero_points is None  # the op's default zero point 8 is the format's
        else:
            zeros = unpack_words(weights[f"{module}.qzeros"], 4, dim=1, size=num_groups).numpy()
            np.testing.assert_array_equal(unpack_nbits(zero_points[:, None, :], 4, k // attrs["block_size"]),
                                          np.repeat(zeros, repeat, 1))
        seen.add(module)
    assert seen == quantized and quantized


def _perplexity(artifact, data):
    result = CliRunner().invoke(cli, ["eval", str(artifact), "--data", str(data), "--seq-len", "128",
                                      "--max-windows", "6", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output[result.output.index("{"):])["perplexity"]


def _check_quantized_pair(model, tmp_path, repo_root, quantization):
    torch_artifact = _build(model, tmp_path / "torch", "cpu", quantization)
    onnx_artifact = _build(model, tmp_path / "onnx", "onnx-cpu", quantization)
    _check_levels(torch_artifact, onnx_artifact)
    prompts = [LLM(torch_artifact, device="cpu").tokenizer.encode(p) for p in PROMPTS[:3]]
    want = _greedy(LLM(torch_artifact, device="cpu"), prompts, 24)
    assert _greedy(LLM(onnx_artifact, device="cpu", max_num_batched_tokens=8), prompts, 24) == want
    data = repo_root / "data" / "heldout.txt"
    ours, theirs = _perplexity(onnx_artifact, data), _perplexity(torch_artifact, data)
    assert abs(ours - theirs) / theirs < 0.005, (ours, theirs)


def _calibration(repo_root):
    return {"data": str(repo_root / "data" / "heldout.txt"), "num_samples": 4, "seq_len": 64}


@pytest.mark.slow  # 14 s on 2 cores: GPTQ on ref-llama-12m, then its graph
def test_gptq_w4_g128_matches_the_torch_runtime(ref_model_dir, tmp_path, repo_root):
    _check_quantized_pair(ref_model_dir, tmp_path, repo_root, {
        "method": "gptq", "bits": 4, "group_size": 128, "calibration": _calibration(repo_root)})


@pytest.mark.slow  # 7 s on 2 cores
def test_rtn_per_channel_with_zero_points_matches_the_torch_runtime(ref_model_dir, tmp_path, repo_root):
    _check_quantized_pair(ref_model_dir, tmp_path, repo_root, {
        "method": "rtn", "bits": 4, "group_size": -1, "symmetric": False})


@pytest.mark.slow
def test_awq_w4_matches_the_torch_runtime(ref_model_dir, tmp_path, repo_root):
    _check_quantized_pair(ref_model_dir, tmp_path, repo_root, {
        "method": "awq", "bits": 4, "group_size": 128, "symmetric": False, "calibration": _calibration(repo_root)})


def test_int8_compute_is_genai_accuracy_level_4_near_the_torch_runtime(ref_model_dir, tmp_path, repo_root):
    """int4_accuracy_level 4 (onnxruntime-genai's CPU default): every MatMulNBits computes with int8
    activation blocks; the levels are still the quantizer's and perplexity stays near the float32 path."""
    quantization = {"method": "rtn", "bits": 4, "group_size": 32}
    torch_artifact = _build(ref_model_dir, tmp_path / "torch", "cpu", quantization)
    onnx_artifact = _build(ref_model_dir, tmp_path / "onnx", "onnx-cpu", quantization, target_extra={"int4_accuracy_level": 4})
    _check_levels(torch_artifact, onnx_artifact)
    assert {attrs["accuracy_level"] for _, attrs, _ in _nbits_nodes(onnx_artifact)} == {4}
    assert art.read_manifest(onnx_artifact).target["onnx"]["int4_accuracy_level"] == 4
    data = repo_root / "data" / "heldout.txt"
    ours, theirs = _perplexity(onnx_artifact, data), _perplexity(torch_artifact, data)
    assert ours != theirs and abs(ours - theirs) / theirs < 0.02, (ours, theirs)


def test_accuracy_level_is_refused_off_onnx_targets(tiny_llama, tmp_path):
    with pytest.raises(RecipeError, match="int4_accuracy_level"):
        _build(tiny_llama, tmp_path / "a", "cpu", target_extra={"int4_accuracy_level": 4})


# ---- limits and errors ---------------------------------------------------------------------------


def test_options_the_slots_cannot_hold_are_refused(tiny_llama, onnx_artifact):
    artifact = onnx_artifact(tiny_llama)
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        LLM(artifact, device="cpu", enable_prefix_caching=True)
    # 256 tokens x 2 layers x 2 KV heads x 16 dims x K,V x 4 bytes = 128 KiB per sequence slot
    with pytest.raises(ConfigError, match="holds 4 sequences"):
        LLM(artifact, device="cpu", cpu_kv_cache_gib=0.5 / 1024, max_num_seqs=5)
    # fewer tokens than one sequence: the count, not a size rounded to "0.00 GiB"
    with pytest.raises(ConfigError, match="num_kv_blocks 8 holds 128 tokens, fewer than one sequence of max_model_len 256"):
        LLM(artifact, device="cpu", num_kv_blocks=8)
    with pytest.raises(ConfigError, match=r"needs 0\.1 MiB of KV cache, more than cpu_kv_cache_gib"):
        LLM(artifact, device="cpu", cpu_kv_cache_gib=0.1 / 1024 / 1024)
    llm = LLM(artifact, device="cpu", cpu_kv_cache_gib=0.5 / 1024)  # the default max_num_seqs is fitted
    assert llm.engine.options.max_num_seqs == 4 and not llm.engine.options.enable_prefix_caching
    # the graph computes in float32, whatever the recipe's dtype: vLLM's dtype names it, or auto
    manifest = art.read_manifest(artifact)
    for dtype in ("float32", "float", "auto"):
        resolve_options(manifest, {"dtype": dtype})
    with pytest.raises(ConfigError, match="dtype 'bfloat16': an ONNX artifact computes in float32"):
        resolve_options(manifest, {"dtype": "bfloat16"})


def test_missing_onnxruntime_is_one_line(tiny_llama, onnx_artifact, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime raises ImportError
    with pytest.raises(ConfigError, match="pip install onnxruntime"):
        LLM(onnx_artifact(tiny_llama), device="cpu")


def test_onnx_target_is_one_rank(tiny_llama, tmp_path):
    with pytest.raises(RecipeError, match="parallel.tensor"):
        _build(tiny_llama, tmp_path / "a", parallel={"tensor": 2})


def test_inspect_shows_the_op_mix_and_size(tiny_llama, onnx_artifact, capsys):
    artifact = onnx_artifact(tiny_llama)
    result = CliRunner().invoke(cli, ["inspect", str(artifact), "--json", "--verify"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    model = onnx.load(str(artifact / "onnx" / "model.onnx"), load_external_data=False)
    assert report["onnx"]["op_counts"]["GroupQueryAttention"] == sum(n.op_type == "GroupQueryAttention" for n in model.graph.node)
    files = [p for p in (artifact / "onnx").iterdir()]
    assert report["weight_bytes"] == sum(p.stat().st_size for p in files)
    assert report["verify"]["ok"]
    text = CliRunner().invoke(cli, ["inspect", str(artifact)]).output
    parameters = next(line for line in text.splitlines() if line.lstrip().startswith("parameters"))
    assert "float32" in parameters and "bfloat16" not in parameters, parameters  # initializers are float32
    from llmc.cli_report import print_build_summary

    class Built:  # what `llmc build` prints: no GPU memory plan for an artifact that runs on the CPU
        manifest, output, seconds, stage_seconds = art.read_manifest(artifact), artifact, 1.0, {}

    print_build_summary(Built())
    summary = capsys.readouterr().out
    assert "float32" in summary and " GiB " not in summary.replace("time", ""), summary
    assert {t.data_type for t in model.graph.initializer if t.data_type in (onnx.TensorProto.FLOAT16,
                                                                           onnx.TensorProto.BFLOAT16)} == set()


@pytest.mark.slow  # 6 s on 2 cores
def test_an_act_order_down_put_in_order_at_build_is_matmulnbits(tiny_llama, tmp_path):
    """A GPTQ desc_act import: the build puts down's groups in order (compiler/shard.order_down_groups), so
    its ONNX linear is a MatMulNBits like a plain one; the other act-order linears stay float MatMuls; the
    ONNX artifact generates what the torch one does."""
    import shutil

    from safetensors.torch import save_file

    from llmc.quant.formats import QuantizedWeight
    from llmc.quant.importers import pack_gptq
    from llmc.quant.rtn import rtn_quantize

    source = tmp_path / "ckpt"
    shutil.copytree(tiny_llama, source)
    tensors = load_file(source / "model.safetensors")
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2].endswith("_proj")]:
        weight = tensors.pop(name).float()
        order = torch.randperm(weight.shape[1], generator=torch.Generator().manual_seed(weight.shape[1]))
        q = rtn_quantize(weight[:, order], 4, 32, True, scale_dtype=torch.float16)
        levels, g_idx = torch.empty_like(q.qweight), torch.empty(weight.shape[1], dtype=torch.int32)
        levels[:, order], g_idx[order] = q.qweight, torch.arange(weight.shape[1], dtype=torch.int32) // 32
        packed = pack_gptq(QuantizedWeight(levels, q.scales, None, 4, 32, g_idx), is_v1=True)
        tensors |= {f"{name[: -len('.weight')]}.{k}": v for k, v in packed.items()}
    save_file(tensors, source / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": True}
    (source / "config.json").write_text(json.dumps(config))
    torch_artifact = _build(source, tmp_path / "torch", "cpu", {"method": "import"})
    onnx_artifact = _build(source, tmp_path / "onnx", "onnx-cpu", {"method": "import"})
    nbits = {module for module, _, _ in _nbits_nodes(onnx_artifact)}
    layers = art.read_manifest(onnx_artifact).model.num_layers
    assert nbits == {f"layers.{i}.mlp.down" for i in range(layers)}
    prompts = [LLM(torch_artifact, device="cpu").tokenizer.encode(p) for p in PROMPTS[:2]]
    assert _greedy(LLM(onnx_artifact, device="cpu"), prompts, 16) == _greedy(LLM(torch_artifact, device="cpu"), prompts, 16)
