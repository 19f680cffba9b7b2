"""method int8 (w8a8-int8, llm-compressor's W8A8 int8) end to end on a tiny Llama: builds against transformers on
the artifact's dequantized weights with per-token int8 activations emulated, a compressed-tensors int-quantized
import written as compressed-tensors writes it, export and re-import, and the recipe's refusals."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmc.compiler.build import build
from llmc.compiler.export import export_artifact
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import CheckpointError, RecipeError
from llmc.runtime.llm import LLM
from tests.conftest import int8_per_token
from tests.runtime.hf_oracle import build_float32, check_quantized_build

PROMPTS = ["ROMEO:", "What light through yonder window breaks? It is the east", "In the beginning"]


@pytest.mark.parametrize("quantization", [
    {"method": "int8"},
    {"method": "int8", "algorithm": "gptq", "smoothquant": 0.8},
], ids=["rtn", "gptq-smoothquant"])
def test_build_matches_transformers_with_int8_activations(quantization, tiny_llama, tmp_path, data_dir, hf_encode):
    check_quantized_build(tiny_llama, tmp_path, data_dir, hf_encode, quantization, PROMPTS)
    manifest = json.loads((tmp_path / "q" / "manifest.json").read_text())
    assert tuple(map(int, manifest["format_version"].split("."))) >= (1, 11)  # the format an older llmc refuses
    formats = {name: s["format"] for name, s in manifest["quant"]["modules"].items()}
    assert set(formats.values()) == {"w8a8-int8"} | ({"dense"} if "lm_head" in formats else set())
    assert formats.get("lm_head", "dense") == "dense"  # (the default ignore)


def test_smoothquant_folds_into_the_norms(tiny_llama, tmp_path, data_dir):
    """The smoothed artifact's pre-norms are the checkpoint's divided by scales (the plain build keeps them); that the
    fold keeps the float model is tests/quant/test_int8.py's float64 check."""
    calibration = {"data": str(data_dir / "calibration.txt"), "num_samples": 4, "seq_len": 32}
    plain = build_float32(tiny_llama, tmp_path / "plain", quantization={"method": "int8", "report": False})
    smooth = build_float32(tiny_llama, tmp_path / "smooth", quantization={
        "method": "int8", "smoothquant": 0.5, "calibration": calibration, "report": False})
    a, b = (load_file(p / "rank-00" / "weights.safetensors") for p in (plain, smooth))
    assert not torch.equal(a["layers.0.input_norm.weight"], b["layers.0.input_norm.weight"])
    assert torch.equal(a["layers.0.input_norm.weight"], load_file(tiny_llama / "model.safetensors")[
        "model.layers.0.input_layernorm.weight"].float())
    assert not torch.equal(a["layers.1.post_attn_norm.weight"], b["layers.1.post_attn_norm.weight"])


def _published_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' symmetric per-channel int8: scale = absmax / 127.5 (bf16), q = clamp(round(w/s), -128, 127)."""
    scale = (weight.float().abs().amax(dim=1, keepdim=True) / 127.5).to(torch.bfloat16)
    return torch.clamp(torch.round(weight.float() / scale.float()), -128, 127).to(torch.int8), scale


INT8_W8A8_CONFIG = {
    "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"], "format": "int-quantized",
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False,
                    "group_size": None, "actorder": None, "observer": "minmax", "observer_kwargs": {}},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True,
                              "group_size": None, "observer": None, "observer_kwargs": {}},
        "output_activations": None}},
    "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {},
}


def _int8_checkpoint(source, dest, with_zero_points=False):
    """`source` as llm-compressor's W8A8 (int-quantized) saves it: each decoder linear's weight int8, weight_scale
    bf16 [out, 1] (and, as some compressed-tensors versions do, weight_zero_point int8 zeros)."""
    shutil.copytree(source, dest)
    tensors = load_file(source / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            module = name.removesuffix(".weight")
            out[module + ".weight"], out[module + ".weight_scale"] = _published_int8(t)
            if with_zero_points:
                out[module + ".weight_zero_point"] = torch.zeros(t.shape[0], 1, dtype=torch.int8)
        else:
            out[name] = t
    save_file(out, dest / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps({**config, "quantization_config": INT8_W8A8_CONFIG}))
    return dest, out


@pytest.mark.parametrize("with_zero_points", [False, True])
def test_compressed_tensors_int_quantized_import_gives_the_same_logits(with_zero_points, tiny_llama, tmp_path):
    checkpoint, tensors = _int8_checkpoint(tiny_llama, tmp_path / "ct", with_zero_points)
    out = build_float32(checkpoint, tmp_path / "imported", quantization={"method": "import"}, target={"device": "cpu"})
    weights = load_file(out / "rank-00" / "weights.safetensors")
    q, k, v = (tensors[f"model.layers.0.self_attn.{m}_proj.weight"] for m in "qkv")
    assert torch.equal(weights["layers.0.attn.qkv.weight"], torch.cat([q, k, v]))  # the checkpoint's own levels
    # the oracle: transformers on the checkpoint's weights dequantized by the published definition, int8 activations
    from transformers import AutoModelForCausalLM
    oracle = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32, attn_implementation="eager")
    state = {n: tensors[n].float() * tensors[n.removesuffix("weight") + "weight_scale"].float()
             if tensors[n].dtype == torch.int8 else tensors[n].float() for n in tensors if not n.endswith(("_scale", "_point"))}
    oracle.load_state_dict(state, strict=False)
    for name, module in oracle.named_modules():
        if name.startswith("model.layers.") and isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda _, args: (int8_per_token(args[0]),))
    token_ids = list(range(1, 50))
    llm = LLM(out, device="cpu", max_num_batched_tokens=16)
    with torch.inference_mode():
        torch.testing.assert_close(llm.engine.score(token_ids), oracle(torch.tensor([token_ids])).logits[0],
                                   atol=1e-4, rtol=1e-4)


def test_export_writes_int_quantized_and_reimports_to_the_same_logits(tiny_llama, tmp_path):
    built = build_float32(tiny_llama, tmp_path / "q", quantization={"method": "int8", "report": False},
                          target={"device": "cpu"})
    exported = tmp_path / "export"
    result = export_artifact(built, exported)
    assert result.format == "int-quantized"
    qc = json.loads((exported / "config.json").read_text())["quantization_config"]
    assert qc["format"] == "int-quantized"
    group = qc["config_groups"]["group_0"]
    assert (group["weights"]["strategy"], group["input_activations"]["strategy"], group["input_activations"]["dynamic"]) \
        == ("channel", "token", True)
    tensors = load_file(exported / "model.safetensors")
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    assert tensors["model.layers.0.self_attn.q_proj.weight_scale"].shape[1] == 1
    again = build_float32(exported, tmp_path / "again", quantization={"method": "import"}, target={"device": "cpu"})
    token_ids = list(range(1, 40))
    a, b = (LLM(p, device="cpu", max_num_batched_tokens=16) for p in (built, again))
    assert torch.equal(a.engine.score(token_ids), b.engine.score(token_ids))


@pytest.mark.parametrize(("change", "words"), [
    ({"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor"}}, "strategy 'tensor'"),
    ({"weights": {"num_bits": 8, "type": "int", "symmetric": False, "strategy": "channel"}}, "symmetric False"),
    ({"input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor", "dynamic": False}},
     "strategy 'tensor', dynamic False"),
    ({"input_activations": None}, "without quantized activations"),
])
def test_import_refuses_other_int_quantized_schemes_by_name(change, words, tiny_llama, tmp_path):
    checkpoint, _ = _int8_checkpoint(tiny_llama, tmp_path / "ct")
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"].update(change)
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=words):
        build_float32(checkpoint, tmp_path / "out", quantization={"method": "import"})


@pytest.mark.parametrize(("quantization", "words"), [
    ({"weights": "per_tensor"}, "per_tensor int8 weights are not supported"),
    ({"activations": "static"}, "static int8 activations .* are not supported"),
    ({"symmetric": False}, "asymmetric int8 weights"),
    ({"smoothquant": 0.8}, "method int8 with smoothquant 0.8 needs a calibration text file"),
    ({"algorithm": "gptq"}, "method int8 with algorithm gptq needs a calibration text file"),
    ({"algorithm": "awq"}, "algorithm"),
    ({"smoothquant": 1.0}, "must be below 1"),
    ({"smoothquant": -0.1}, "smoothquant"),
    ({"overrides": [{"match": "*down_proj", "bits": 4}]}, "one scheme"),
])
def test_recipe_refusals_are_one_line(quantization, words, tiny_llama, tmp_path):
    with pytest.raises(RecipeError, match=words) as e:
        recipe_from_dict({"model": str(tiny_llama), "output": str(tmp_path / "o"),
                          "quantization": {"method": "int8", **quantization}})
    assert "\n" not in str(e.value)


def test_onnx_target_is_accepted(tiny_llama, tmp_path):
    """onnx-cpu builds w8a8-int8 linears as MatMulInteger (tests/runtime/test_onnx_int8.py); it was refused before."""
    recipe = recipe_from_dict({"model": str(tiny_llama), "output": str(tmp_path / "o"), "quantization": {"method": "int8"},
                               "target": {"device": "onnx-cpu"}})
    assert recipe.target.device == "onnx-cpu" and recipe.quantization.method == "int8"


def test_smoothquant_without_pre_norms_is_refused_by_name(tiny_olmo2, tmp_path, data_dir):
    recipe = recipe_from_dict({"model": str(tiny_olmo2), "output": str(tmp_path / "o"), "quantization": {
        "method": "int8", "smoothquant": 0.8, "calibration": {"data": str(data_dir / "calibration.txt"), "seq_len": 32}}})
    with pytest.raises(RecipeError, match="no norm before qkv and gate_up"):
        build(recipe, show_progress=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_int8_artifact_on_cuda_agrees_with_the_cpu(tiny_llama, tmp_path, hf_encode, free_gpu):
    """A float32 int8 artifact on CUDA (cuBLAS _int_mm under CUDA graphs, the Triton attention) against the same
    artifact on the CPU: the integer products are exact on both, so what differs is the float path around them
    and an activation level it flips (bounds as gpu_cpu_agreement.py measures float32 FP8: cosine min 0.995)."""
    out = build_float32(tiny_llama, tmp_path / "a", quantization={"method": "int8", "report": False})
    token_ids = hf_encode(tiny_llama, PROMPTS[1]) + list(range(100, 140))
    from llmc.runtime.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": hf_encode(tiny_llama, p)} for p in PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=16)
    cpu_llm = LLM(out, device="cpu")
    cpu = cpu_llm.engine.score(token_ids).float()
    want = [o.outputs[0].token_ids for o in cpu_llm.generate(prompts, greedy)]
    cpu_llm.close()
    llm = LLM(out, device="cuda", gpu_memory_utilization=0.3, max_num_seqs=3, max_num_batched_tokens=16)
    gpu = llm.engine.score(token_ids).float().cpu()
    cosine = torch.nn.functional.cosine_similarity(gpu, cpu, dim=-1)
    assert cosine.min() > 0.99 and cosine.mean() > 0.999, (cosine.min(), cosine.mean())
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]  # decode steps: CUDA graph replays
    assert got == want
    llm.close()
