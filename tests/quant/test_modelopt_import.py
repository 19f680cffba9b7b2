"""NVIDIA TensorRT Model Optimizer (ModelOpt) FP8 checkpoints: import as vLLM's `quantization="modelopt"` reads them,
and every refusal.

The checkpoints are written here in ModelOpt's published layout from a tiny transformers Llama, quantized by the
definition, independently of llmc: per linear `weight` float8_e4m3fn = E4M3(w / scale) with scale = absmax / 448 in
float64 (stored float32): one per tensor for quant_algo FP8 (`weight_scale` [], with a static `input_scale` [] =
the input's absmax / 448 on a calibration prompt, as ModelOpt's max calibration gives), one per output channel for
FP8_PER_CHANNEL_PER_TOKEN (`weight_scale` [out], no input_scale); `exclude_modules` left dense; with
kv_cache_quant_algo FP8, `self_attn.k_proj.k_scale` / `v_proj.v_scale` []. The config is `hf_quant_config.json` beside
config.json, or config.json's quantization_config with quant_method modelopt (ModelOpt's two forms).

The oracle is transformers' model holding the dequantized weights (levels × scale in float64, rounded once to
float32), each quantized linear's input rounded to E4M3 as the format rounds it: statically at its input_scale (the
largest of a fused q/k/v or gate/up's, which vLLM and llmc both take), or per token at absmax / 448.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmc.errors import CheckpointError
from llmc.quant.import_config import parse_quantization_config
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from tests.conftest import fp8_per_token
from tests.runtime.hf_oracle import build_float32, build_import

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
EXCLUDED = "model.layers.1.mlp.down_proj"
EXCLUDE = ["lm_head", EXCLUDED + "*"]  # ModelOpt's "module_path*": the module and its subtree
PROMPT = "The quick brown fox jumps over the lazy dog, and then"
FUSED = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}  # member → the first of its fused linear
INPUT_SCALE_FACTORS = {"k_proj": 1.5, "v_proj": 1.25}  # q/k/v given different input scales: the fused one is the max
K_SCALES, V_SCALES = [1.0, 1.25], [1.5, 2.0]


def e4m3(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w.double() / scale.double()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def input_amax(checkpoint, token_ids) -> dict[str, float]:
    """Each decoder linear's input absmax over `token_ids` in transformers' float32 model (ModelOpt's max calibration)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32, attn_implementation="eager")
    amax = {}
    for name, module in model.named_modules():
        if (name.startswith("model.layers.") or name == "lm_head") and isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda _, args, name=name: amax.__setitem__(name, float(args[0].abs().max())))
    with torch.inference_mode():
        model(torch.tensor([token_ids]))
    return amax


def write_modelopt(source, dest, token_ids, algo="FP8", form="hf_quant_config", kv=True, exclude=EXCLUDE):
    """`source` as ModelOpt exports it (module docstring). Returns {module: (levels, weight_scale, input_scale | None)}."""
    shutil.copytree(source, dest)
    amax = input_amax(source, token_ids) if algo == "FP8" else {}
    tensors, quantized = {}, {}
    for name, weight in load_file(source / "model.safetensors").items():
        module = name.removesuffix(".weight")
        kind = module.rsplit(".", 1)[-1]
        if (kind not in LINEARS or module == EXCLUDED) and not (module == "lm_head" and "lm_head" not in exclude):
            tensors[name] = weight
            continue
        w = weight.double()
        if algo == "FP8":
            scale = (w.abs().max() / 448.0).float()  # []
            input_scale = torch.tensor(amax[module] / 448.0 * INPUT_SCALE_FACTORS.get(kind, 1.0), dtype=torch.float32)
            tensors[module + ".input_scale"] = input_scale
        else:
            scale, input_scale = (w.abs().amax(dim=1) / 448.0).float(), None  # [out]
        levels = e4m3(w, scale.reshape(-1, 1))
        tensors[name], tensors[module + ".weight_scale"] = levels, scale
        quantized[module] = (levels, scale, input_scale)
    layers = sorted({int(m.split(".")[2]) for m in quantized if m.startswith("model.layers.")})
    if kv:
        for i in layers:
            tensors[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(K_SCALES[i])
            tensors[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(V_SCALES[i])
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    section = {"quant_algo": algo, "kv_cache_quant_algo": "FP8" if kv else None, "exclude_modules": list(exclude)}
    if form == "hf_quant_config":
        (dest / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt", "version": "0.37.0"}, "quantization": section}, indent=2))
    else:  # config.json, as newer ModelOpt writes it (and vLLM reads): flat, `ignore`, `kv_cache_scheme`
        config = json.loads((dest / "config.json").read_text())
        config["quantization_config"] = {
            "quant_method": "modelopt", "quant_algo": algo, "ignore": list(exclude),
            "kv_cache_scheme": {"type": "float", "num_bits": 8, "dynamic": False} if kv else None,
            "producer": {"name": "modelopt", "version": "0.39.0"}}
        (dest / "config.json").write_text(json.dumps(config, indent=2))
    return quantized


def _fused_linear(module: str) -> str:
    """The runtime linear a checkpoint module fuses into, named by its first member (k_proj → q_proj)."""
    prefix, _, kind = module.rpartition(".")
    return f"{prefix}.{FUSED.get(kind, kind)}"


def oracle_of(source, quantized):
    """transformers' float model of `source` holding the dequantized weights, each quantized linear's input rounded as
    the format rounds it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32, attn_implementation="eager")
    state = {m + ".weight": (levels.double() * scale.double().reshape(-1, 1)).float()
             for m, (levels, scale, _) in quantized.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected
    modules = dict(model.named_modules())
    for module, (_, _, input_scale) in quantized.items():
        if input_scale is None:
            modules[module].register_forward_pre_hook(lambda _, args: (fp8_per_token(args[0]),))
            continue
        fused = [m for m in quantized if _fused_linear(m) == _fused_linear(module)]
        scale = max(float(quantized[m][2]) for m in fused)
        modules[module].register_forward_pre_hook(
            lambda _, args, s=scale: ((args[0] / s).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * s,))
    return model.eval()


@pytest.mark.parametrize(("algo", "form", "exclude"), [
    ("FP8", "hf_quant_config", EXCLUDE), ("FP8_PER_CHANNEL_PER_TOKEN", "config.json", EXCLUDE),
    ("FP8", "config.json", EXCLUDE[1:]),  # lm_head quantized too, as vLLM reads it when exclude_modules leaves it
], ids=["FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8-quantized-head"])
def test_modelopt_import_matches_transformers_on_the_dequantized_weights(algo, form, exclude, tiny_llama, tmp_path,
                                                                        hf_encode):
    token_ids = hf_encode(tiny_llama, PROMPT) + list(range(100, 120))
    quantized = write_modelopt(tiny_llama, tmp_path / "ckpt", token_ids[:12], algo=algo, form=form, exclude=exclude)
    out = build_import(tmp_path / "ckpt", tmp_path / "out")
    manifest = json.loads((out / "manifest.json").read_text())
    formats = manifest["quant"]["modules"]
    static = algo == "FP8"
    assert formats["layers.0.attn.qkv"] == {"format": "w8a8-fp8", "is_per_channel": True, "is_static_input": static}
    assert formats["layers.1.mlp.down"]["format"] == "dense"
    assert formats["lm_head"]["format"] == ("w8a8-fp8" if "lm_head" in quantized else "dense")
    assert formats["layers.0.mlp.down"]["format"] == "w8a8-fp8"
    # the checkpoint's own levels and scales (a per-tensor scale repeated per channel); static input scales fused by max
    weights = load_file(out / "rank-00" / "weights.safetensors")
    qkv = [quantized[f"model.layers.0.self_attn.{m}_proj"] for m in "qkv"]
    assert torch.equal(weights["layers.0.attn.qkv.weight"].view(torch.uint8),
                       torch.cat([levels for levels, _, _ in qkv]).view(torch.uint8))
    want_scales = torch.cat([scale.reshape(-1, 1).expand(len(levels), 1) for levels, scale, _ in qkv])
    assert torch.equal(weights["layers.0.attn.qkv.weight_scale"], want_scales)
    if static:
        assert torch.equal(weights["layers.0.attn.qkv.input_scale"], torch.stack([s for _, _, s in qkv]).max().reshape(1))
    else:
        assert "layers.0.attn.qkv.input_scale" not in weights
    assert torch.equal(weights["layers.1.mlp.down.weight"], load_file(tiny_llama / "model.safetensors")[EXCLUDED + ".weight"])
    # the KV cache scales, as the checkpoint stores them
    assert (manifest["kv"]["k_scales"], manifest["kv"]["v_scales"], manifest["kv"]["scales_source"]) == (
        K_SCALES, V_SCALES, "checkpoint")
    oracle = oracle_of(tiny_llama, quantized)  # the float model, its quantized linears replaced
    llm = LLM(out, device="cpu", max_num_batched_tokens=16)
    with torch.inference_mode():
        torch.testing.assert_close(llm.engine.score(token_ids), oracle(torch.tensor([token_ids])).logits[0],
                                   atol=1e-4, rtol=1e-4)
        prompt = token_ids[:12]
        want = oracle.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    got = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8))
    assert got[0].outputs[0].token_ids == want
    llm.close()


def test_a_mixture_of_experts_checkpoint_imports_each_expert_s_levels_and_scales(tiny_qwen3_moe, tmp_path):
    """Qwen3-MoE as ModelOpt exports it: one module per expert, the routers dense (ModelOpt's "*.mlp.gate")."""
    quantized = write_modelopt(tiny_qwen3_moe, tmp_path / "ckpt", [], algo="FP8_PER_CHANNEL_PER_TOKEN", form="config.json",
                               kv=False, exclude=["lm_head", "*.mlp.gate", EXCLUDED + "*"])
    out = build_import(tmp_path / "ckpt", tmp_path / "out")
    formats = json.loads((out / "manifest.json").read_text())["quant"]["modules"]
    assert formats["layers.0.moe.experts.gate_up"]["format"] == "w8a8-fp8" and formats["layers.1.mlp.down"]["format"] == "dense"
    weights = load_file(out / "rank-00" / "weights.safetensors")
    experts = [[quantized[f"model.layers.0.mlp.experts.{e}.{m}_proj"] for m in ("gate", "up")] for e in range(4)]
    assert torch.equal(weights["layers.0.moe.experts.gate_up.weight"].view(torch.uint8),
                       torch.stack([torch.cat([levels for levels, _, _ in e]) for e in experts]).view(torch.uint8))
    assert torch.equal(weights["layers.0.moe.experts.gate_up.weight_scale"],
                       torch.stack([torch.cat([scale for _, scale, _ in e]).reshape(-1, 1) for e in experts]))
    assert torch.equal(weights["layers.0.moe.gate.weight"],
                       load_file(tiny_qwen3_moe / "model.safetensors")["model.layers.0.mlp.gate.weight"])


@pytest.mark.parametrize("naming", ["self_attn.{kind}_proj.{kind}_scale", "self_attn.{kind}_scale"])
def test_kv_scales_under_either_name(naming, tmp_path):
    """ModelOpt's k_proj.k_scale / v_proj.v_scale, and self_attn.k_scale (what vLLM remaps them to)."""
    from llmc.compiler.hf_checkpoint import TensorReader
    from llmc.compiler.kv_scales import checkpoint_kv_scales
    from llmc.runtime.models import spec_for_architecture

    save_file({f"model.layers.{i}." + naming.format(kind=kind): torch.tensor(s)
               for kind, scales in (("k", K_SCALES), ("v", V_SCALES)) for i, s in enumerate(scales)},
              tmp_path / "model.safetensors")
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8",
                                                                                "kv_cache_quant_algo": "FP8"}}))
    with TensorReader(tmp_path) as reader:
        spec = spec_for_architecture("LlamaForCausalLM")
        scales = checkpoint_kv_scales({}, reader, spec, 2)
        assert (scales.k_scales, scales.v_scales, scales.source) == (K_SCALES, V_SCALES, "checkpoint")
        assert checkpoint_kv_scales({"quantization_config": {"quant_method": "modelopt", "quant_algo": "FP8"}},
                                    reader, spec, 2) is None  # no KV quantization: no scales


def modelopt(algo="FP8", **section) -> dict:
    return {"quant_method": "modelopt", "quantization": {"quant_algo": algo, "exclude_modules": ["lm_head"], **section}}


def test_exclude_modules_match_as_vllm_reads_them():
    spec = parse_quantization_config(modelopt(exclude_modules=["lm_head", "model.layers.1*", "*.mlp.gate", "*self_attn.o_proj"]))
    excluded = ["lm_head", "model.layers.1.mlp.down_proj", "model.layers.0.mlp.gate", "model.layers.0.self_attn.o_proj"]
    kept = ["model.layers.11.mlp.down_proj", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.down_proj"]
    assert [spec.is_ignored(m) for m in excluded + kept] == [True] * len(excluded) + [False] * len(kept)


@pytest.mark.parametrize(("config", "words"), [
    *[(modelopt(algo), f"quant_algo '{algo}'.* is not supported; llmc imports ModelOpt FP8")
      for algo in ("NVFP4", "FP8_PB_WO", "W4A8_AWQ", "INT4_AWQ", "MIXED_PRECISION", "W4A16_NVFP4", "MXFP8", "INT8_SQ")],
    (modelopt(None), "quant_algo None"),
    ({"quant_method": "modelopt_fp4", "quant_algo": "NVFP4", "ignore": ["lm_head"]}, "quant_algo 'NVFP4' .*NVFP4"),
    (modelopt(kv_cache_quant_algo="NVFP4"), "kv_cache_quant_algo 'NVFP4' is not supported"),
    (modelopt(exclude_modules="lm_head"), "exclude_modules 'lm_head' is not a list"),
    ({"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_scheme": {"type": "int", "num_bits": 8}},
     "kv_cache_scheme .* is not supported"),
])
def test_refusals_are_one_line(config, words):
    with pytest.raises(CheckpointError, match=words) as e:
        parse_quantization_config(config)
    assert "\n" not in str(e.value)


def _rewrite(checkpoint, change):
    tensors = load_file(checkpoint / "model.safetensors")
    change(tensors)
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(("change", "words"), [
    # AWQ's smoothing factor on an FP8 linear: it would change the numbers
    (lambda t: t.__setitem__("model.layers.0.self_attn.o_proj.pre_quant_scale", torch.ones(64)),
     r"o_proj has \['pre_quant_scale'\], which ModelOpt FP8 does not define"),
    (lambda t: t.pop("model.layers.0.mlp.gate_proj.input_scale"), r"gate_proj lacks \['input_scale'\]"),
    # exclude_modules says dense, the tensors are FP8 (the config does not describe the checkpoint)
    (lambda t: t.__setitem__(EXCLUDED + ".weight", t[EXCLUDED + ".weight"].to(torch.float8_e4m3fn)),
     "down_proj is quantized in the checkpoint .* but quantization_config leaves it dense"),
    (lambda t: t.pop("model.layers.1.self_attn.v_proj.v_scale"), "has a kv_cache_quant_algo FP8 but the weights lack"),
])
def test_tensors_the_config_does_not_describe_are_refused(change, words, tiny_llama, tmp_path, hf_encode):
    write_modelopt(tiny_llama, tmp_path / "ckpt", list(range(1, 9)))
    _rewrite(tmp_path / "ckpt", change)
    with pytest.raises(CheckpointError, match=words) as e:
        build_import(tmp_path / "ckpt", tmp_path / "out")
    assert "\n" not in str(e.value)


def test_an_input_scale_with_per_token_activations_is_refused(tiny_llama, tmp_path):
    write_modelopt(tiny_llama, tmp_path / "ckpt", [], algo="FP8_PER_CHANNEL_PER_TOKEN", kv=False)
    _rewrite(tmp_path / "ckpt", lambda t: t.__setitem__("model.layers.0.mlp.up_proj.input_scale", torch.tensor(0.1)))
    with pytest.raises(CheckpointError, match=r"up_proj has \['input_scale'\], which ModelOpt FP8_PER_CHANNEL_PER_TOKEN"):
        build_import(tmp_path / "ckpt", tmp_path / "out")


def test_a_float_build_of_a_modelopt_checkpoint_is_refused(tiny_llama, tmp_path):
    write_modelopt(tiny_llama, tmp_path / "ckpt", [], algo="FP8_PER_CHANNEL_PER_TOKEN")
    with pytest.raises(CheckpointError, match="quant_method 'modelopt'.* build it with quantization.method: import"):
        build_float32(tmp_path / "ckpt", tmp_path / "out", quantization={"method": "rtn"})
