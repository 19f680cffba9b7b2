"""Phi-3 (Phi3ForCausalLM), whose checkpoints store q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`.

Each quantization method's artifact (and a bfloat16 one) against transformers' Phi3ForCausalLM running the
artifact's own weights (dequantized, under Phi-3's fused names), Phi3Config's defaults, the refusals by name, LongRoPE,
and a partial rotary (Phi-4-mini's partial_rotary_factor) on the CPU and onnx-cpu, refused on CUDA. The float32
logits and greedy tokens, ONNX, tensor parallelism, imports, export and sliding windows run with the other families
(tiny_checkpoint in test_hf_equivalence, test_onnx_target, test_parallel_models, test_quantized_build, test_export)."""

import dataclasses
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import CheckpointError, ConfigError, RecipeError
from llmc.quant.formats import make_format
from llmc.quant.reference import dequantize
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from tests.conftest import fp8_per_token

CALIBRATION = {"num_samples": 4, "seq_len": 64}
METHODS = {
    "rtn-w4-g32": {"method": "rtn", "bits": 4, "group_size": 32, "ignore": ["lm_head", "gate_up_proj"]},  # Phi-3's name
    # act order with static groups (quant/gptq.py): no g_idx; a desc_act import's g_idx, down put in order with
    # gate_up's rows, is test_quantized_build's act-order import
    "gptq-w4-g32-act-order": {"method": "gptq", "bits": 4, "group_size": 32, "act_order": True,
                              "calibration": CALIBRATION},
    "awq-w4-g32-asym": {"method": "awq", "bits": 4, "group_size": 32, "symmetric": False, "calibration": CALIBRATION},
    "fp8-dynamic": {"method": "fp8"},
}
# runtime name in a layer → Phi-3's (transformers') name
HF_NAMES = {"attn.qkv": "self_attn.qkv_proj", "attn.o": "self_attn.o_proj", "mlp.gate_up": "mlp.gate_up_proj",
            "mlp.down": "mlp.down_proj", "input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm"}


def _hf_state_of(artifact) -> dict[str, torch.Tensor]:
    """The artifact's weights as Phi3ForCausalLM's state dict: each linear dequantized by the formats' oracle
    (quant/reference.py), the norms as the artifact holds them (AWQ folds its scales into them)."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    tensors = load_file(artifact / "rank-00" / "weights.safetensors")
    state = {"model.embed_tokens.weight": tensors["embed.weight"], "model.norm.weight": tensors["norm.weight"],
             "lm_head.weight": tensors["lm_head.weight"]}
    for i in range(manifest["model"]["num_layers"]):
        for runtime, hf in HF_NAMES.items():
            prefix = f"layers.{i}.{runtime}."
            params = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
            if runtime.endswith("norm"):
                weight = params["weight"]
            else:
                weight = dequantize(make_format(manifest["quant"]["modules"][f"layers.{i}.{runtime}"], torch.float32),
                                    params)
            state[f"model.layers.{i}.{hf}.weight"] = weight.float()
    return state


@torch.inference_mode()
@pytest.mark.parametrize("method", [pytest.param(m, marks=pytest.mark.slow) if m == "fp8-dynamic" else m for m in METHODS])
def test_quantized_builds_run_transformers_phi3_on_their_weights(method, tiny_phi3, tmp_path, data_dir, hf_encode):
    from transformers import AutoModelForCausalLM

    quant = dict(METHODS[method])
    if "calibration" in quant:
        quant["calibration"] = {**quant["calibration"], "data": str(data_dir / "wikitext2-valid-head.txt")}
    out = tmp_path / "a"
    build(recipe_from_dict({"model": str(tiny_phi3), "output": str(out), "dtype": "float32", "target": {"device": "cpu"},
                            "quantization": {**quant, "report": False}, "runtime": {"max_model_len": 128}}),
          show_progress=False)
    modules = json.loads((out / "manifest.json").read_text())["quant"]["modules"]
    assert modules["layers.1.attn.qkv"]["format"] == ("w8a8-fp8" if method.startswith("fp8") else "w4a16")
    assert (modules["layers.1.mlp.gate_up"]["format"] == "dense") == method.startswith("rtn")
    oracle = AutoModelForCausalLM.from_pretrained(str(tiny_phi3), dtype=torch.float32, attn_implementation="eager")
    oracle.load_state_dict(_hf_state_of(out), strict=True)
    oracle.eval()

    if method.startswith("fp8"):  # dynamic activations: each token's input to a layer linear rounded to E4M3
        for name, module in oracle.named_modules():
            if name.startswith("model.layers.") and isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(lambda _, args: (fp8_per_token(args[0]),))
    token_ids = hf_encode(tiny_phi3, "The quick brown fox") + list(range(50, 80))
    theirs = oracle(torch.tensor([token_ids])).logits[0]
    llm = LLM(out, device="cpu", max_num_seqs=2, max_num_batched_tokens=16)
    torch.testing.assert_close(llm.engine.score(token_ids), theirs, atol=1e-4, rtol=1e-4)
    prompt = hf_encode(tiny_phi3, "ROMEO:")
    want = oracle.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                           max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    got = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=24))
    assert got[0].outputs[0].token_ids == want


@torch.inference_mode()
def test_bfloat16_build_is_transformers_on_the_rounded_weights(tiny_phi3, tmp_path, hf_encode):
    """A bfloat16 artifact holds the fused tensors rounded to bf16; the CPU runtime computes in float32, so
    transformers' float32 Phi3ForCausalLM on the same rounded weights gives its logits."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "a"
    build(recipe_from_dict({"model": str(tiny_phi3), "output": str(out), "dtype": "bfloat16",
                            "runtime": {"max_model_len": 128}}), show_progress=False)
    oracle = AutoModelForCausalLM.from_pretrained(str(tiny_phi3), dtype=torch.float32, attn_implementation="eager")
    for p in oracle.parameters():
        p.copy_(p.bfloat16().float())
    token_ids = hf_encode(tiny_phi3, "What light through yonder window breaks") + list(range(100, 140))
    theirs = oracle.eval()(torch.tensor([token_ids])).logits[0]
    torch.testing.assert_close(LLM(out, device="cpu").engine.score(token_ids), theirs, atol=1e-4, rtol=1e-4)


def test_keys_the_config_leaves_out_take_phi3configs_defaults(tiny_phi3, tmp_path):
    """rms_norm_eps 1e-5, 4096 positions, bos 1, eos 32000: transformers' own reading of the same config.json."""
    from transformers import AutoConfig

    from llmc.compiler.hf_checkpoint import model_config_from_hf, model_spec_for, read_hf_config

    path = tmp_path / "ckpt"
    path.mkdir()
    config = json.loads((tiny_phi3 / "config.json").read_text())
    for key in ("rms_norm_eps", "max_position_embeddings", "bos_token_id", "eos_token_id", "sliding_window"):
        del config[key]
    (path / "config.json").write_text(json.dumps(config))
    theirs = AutoConfig.from_pretrained(str(path))
    ours = model_config_from_hf(read_hf_config(path), model_spec_for(config, path), "float32")
    assert (ours.rms_norm_eps, ours.max_position_embeddings, ours.bos_token_id, ours.eos_token_ids, ours.sliding_window) \
        == (theirs.rms_norm_eps, theirs.max_position_embeddings, theirs.bos_token_id, [theirs.eos_token_id],
            theirs.sliding_window) == (1e-5, 4096, 1, [32000], None)


def _with_config(tiny_phi3, path, **changes):
    shutil.copytree(tiny_phi3, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **changes}))
    return path




@pytest.mark.parametrize("changes,said", [
    # a partial rotary runs on a CPU: the default target (cuda) is refused, saying which targets take it. Phi-4-mini
    # keeps the factor at the top level; transformers 5 writes it into rope_parameters
    ({"partial_rotary_factor": 0.75, "rope_parameters": None, "rope_theta": 1e4, "rope_scaling": None},
     "target.device cuda: Phi3ForCausalLM: partial_rotary_factor (rotary on 24 of head_dim 32's dims) is not "
     "supported on CUDA, whose kernels rotate whole heads; it runs on a CPU: build with target.device cpu"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "rotary on 16 of head_dim 32's dims) is not supported on CUDA"),
    # int(32 * 0.3) = 9 dims: rotate-half pairs an even number
    ({"partial_rotary_factor": 0.3, "rope_parameters": None, "rope_theta": 1e4, "rope_scaling": None},
     "partial_rotary_factor 0.3 rotates 9 of head_dim 32's dims"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
], ids=["partial-rotary-top-level-on-cuda", "partial-rotary-in-rope-parameters-on-cuda", "partial-rotary-odd", "gelu"])
def test_what_the_runtime_cannot_compute_is_refused_by_name(tiny_phi3, tmp_path, changes, said, llmc_cli):
    from transformers import AutoConfig

    checkpoint = _with_config(tiny_phi3, tmp_path / "ckpt", **changes)
    AutoConfig.from_pretrained(str(checkpoint))  # a config transformers takes
    with pytest.raises((CheckpointError, RecipeError), match=re.escape(said)):
        build(recipe_from_dict({"model": str(checkpoint), "output": str(tmp_path / "a")}), show_progress=False)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model: {checkpoint}\noutput: {tmp_path / 'a'}\n")
    code, err = llmc_cli("build", recipe, "-q")
    errors = [line for line in err.splitlines() if line.startswith("llmc: error:")]
    assert code not in (0, None) and "Traceback" not in err and len(errors) == 1 and said in errors[0], err
    assert not (tmp_path / "a").exists()


# head_dim 32 = hidden 128 / 4 heads (Phi3Config checks the factors' count against hidden / heads, its rotary
# computes head_dim's): 16 factors each, short factors that change every frequency
SHORT = [1.0 + 0.25 * i for i in range(16)]
LONG = [8.0 + i for i in range(16)]


@pytest.mark.parametrize("changes", [
    # as Phi-3.5-mini's config.json: the original context at the top level (transformers gives it priority)
    {"rope_parameters": None, "rope_theta": 1e4, "original_max_position_embeddings": 64, "max_position_embeddings": 1024,
     "rope_scaling": {"type": "longrope", "short_factor": SHORT, "long_factor": LONG}},
    {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": SHORT, "long_factor": LONG},
     "original_max_position_embeddings": 64, "max_position_embeddings": 1024},
    # "yarn", which Phi3Config reads as longrope
    pytest.param({"rope_parameters": None, "rope_theta": 1e4, "original_max_position_embeddings": 64,
                  "max_position_embeddings": 1024, "rope_scaling": {"type": "yarn", "short_factor": SHORT,
                                                                    "long_factor": LONG}}, marks=pytest.mark.slow),
], ids=["rope-scaling", "rope-parameters", "yarn-is-longrope"])
def test_longrope_runs_within_its_original_context_as_transformers(hf_checkpoint_factory, tmp_path, changes, hf_logits,
                                                                   hf_greedy, hf_encode):
    """LongRoPE (Phi-3-*-128k, Phi-3.5) with its short factors and attention factor (sqrt(1 + ln 16 / ln 64)
    here), as transformers computes a sequence within original_max_position_embeddings; the context is held
    to it, and a longer max_model_len is refused by name."""
    checkpoint = hf_checkpoint_factory(tmp_path / "ckpt", "phi3", hidden_size=128, sliding_window=None)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, **changes}))
    out = tmp_path / "a"
    build(recipe_from_dict({"model": str(checkpoint), "output": str(out), "dtype": "float32"}), show_progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["runtime"]["max_model_len"] == 64
    token_ids = hf_encode(checkpoint, "What light through yonder window breaks?") + list(range(100, 140))
    assert len(token_ids) <= 64
    llm = LLM(out, device="cpu")
    torch.testing.assert_close(llm.engine.score(token_ids), hf_logits(checkpoint, token_ids), atol=1e-4, rtol=1e-4)
    prompt = "ROMEO:"
    want = hf_greedy(checkpoint, [prompt], 40)[0]
    got = llm.generate([{"prompt_token_ids": hf_encode(checkpoint, prompt)}], SamplingParams(temperature=0, max_tokens=40))
    assert got[0].outputs[0].token_ids == want
    llm.close()
    # exported, transformers reads the same LongRoPE back (its original context included)
    from llmc.compiler.export import export_artifact

    export_artifact(out, tmp_path / "export")
    past_original = token_ids + list(range(200, 240))  # transformers switches to the long factors past 64
    assert len(past_original) > 64
    torch.testing.assert_close(hf_logits(tmp_path / "export", past_original), hf_logits(checkpoint, past_original),
                               atol=1e-4, rtol=1e-4)
    with pytest.raises(RecipeError, match="128 exceeds the model's context of 64 \\(LongRoPE's original_max_position"):
        build(recipe_from_dict({"model": str(checkpoint), "output": str(tmp_path / "b"), "dtype": "float32",
                                "runtime": {"max_model_len": 128}}), show_progress=False)


# Phi-4-mini's partial rotary at a tiny size: head_dim 32 = hidden 128 / 4 heads (Phi3Config counts LongRoPE's factors
# over hidden / heads x factor), factor 0.5: the leading 16 dims of each head rotate (8 frequencies), 16 pass through
PARTIAL = {"partial_rotary_factor": 0.5, "rope_parameters": None, "rope_theta": 1e4, "rope_scaling": None}
PARTIAL_ROPES = {
    "default": {},
    # within the original context (64), as the LongRoPE test above; short factors that change every frequency
    "longrope": {"original_max_position_embeddings": 64, "max_position_embeddings": 1024,
                 "rope_scaling": {"type": "longrope", "short_factor": SHORT[:8], "long_factor": LONG[:8]}},
}


@pytest.fixture(scope="module")
def partial_phi3(tmp_path_factory):
    """rope → a tiny Phi-3 checkpoint with partial_rotary_factor 0.5 (made once per rope)."""
    from tests.conftest import make_hf_checkpoint

    made = {}

    def get(rope: str):
        if rope not in made:
            path = make_hf_checkpoint(tmp_path_factory.mktemp(f"partial-{rope}") / "ckpt", "phi3", hidden_size=128,
                                      sliding_window=None)
            config = json.loads((path / "config.json").read_text())
            (path / "config.json").write_text(json.dumps({**config, **PARTIAL, **PARTIAL_ROPES[rope]}))
            made[rope] = path
        return made[rope]

    return get


@torch.inference_mode()
@pytest.mark.parametrize("target", ["cpu", "onnx-cpu"])
@pytest.mark.parametrize("rope", list(PARTIAL_ROPES))
def test_partial_rotary_runs_as_transformers(partial_phi3, rope, target, tmp_path, hf_model, hf_logits, hf_greedy,
                                             hf_encode):
    """The leading int(head_dim x factor) dims of each q/k head rotated, the frequencies (LongRoPE's short factors)
    over them, the rest passed through: logits and greedy tokens as transformers', on the CPU torch path and on
    onnx-cpu (GroupQueryAttention given the 16-dim table rotates those 16 dims and passes the other 16)."""
    checkpoint = partial_phi3(rope)
    assert hf_model(checkpoint).model.rotary_emb.inv_freq.numel() == 8  # transformers' partial rotary: 8, not 16
    out = tmp_path / "a"
    build(recipe_from_dict({"model": str(checkpoint), "output": str(out), "dtype": "float32",
                            "target": {"device": target}, "runtime": {"max_model_len": 64}}), show_progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["model"]["rotary_dim"], manifest["model"]["head_dim"]) == (16, 32)
    token_ids = hf_encode(checkpoint, "What light through yonder window breaks?") + list(range(100, 140))
    assert len(token_ids) <= 64
    llm = LLM(out, device="cpu", max_num_batched_tokens=16)  # chunked: later chunks rotate at their positions
    torch.testing.assert_close(llm.engine.score(token_ids), hf_logits(checkpoint, token_ids), atol=1e-4, rtol=1e-4)
    prompts = ["ROMEO:", "The quick brown fox"]
    want = hf_greedy(checkpoint, prompts, 24)
    got = llm.generate([{"prompt_token_ids": hf_encode(checkpoint, p)} for p in prompts],
                       SamplingParams(temperature=0, max_tokens=24))
    assert [o.outputs[0].token_ids for o in got] == want
    llm.close()


@torch.inference_mode()
def test_partial_rotary_rtn_build_is_transformers_on_its_weights(partial_phi3, tmp_path, hf_encode):
    """An RTN build of a partial-rotary Phi-3 runs as transformers' Phi3ForCausalLM on the dequantized weights."""
    from transformers import AutoModelForCausalLM

    checkpoint = partial_phi3("default")
    out = tmp_path / "a"
    build(recipe_from_dict({"model": str(checkpoint), "output": str(out), "dtype": "float32",
                            "target": {"device": "cpu"}, "quantization": {**METHODS["rtn-w4-g32"], "report": False},
                            "runtime": {"max_model_len": 128}}), show_progress=False)
    oracle = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32, attn_implementation="eager")
    oracle.load_state_dict(_hf_state_of(out), strict=True)
    token_ids = hf_encode(checkpoint, "The quick brown fox") + list(range(50, 80))
    llm = LLM(out, device="cpu")
    torch.testing.assert_close(llm.engine.score(token_ids), oracle.eval()(torch.tensor([token_ids])).logits[0],
                               atol=1e-4, rtol=1e-4)
    llm.close()


def test_partial_rotary_is_refused_on_cuda_by_name(partial_phi3, tmp_path):
    """The Triton kernels rotate whole heads: the engine (and every rank's load) refuses a partial-rotary artifact on
    CUDA in one line, before any weight is read (simulated here: the check the engine calls once it has resolved
    the device); the same model on the CPU, and a whole-head one on CUDA, pass."""
    from llmc.runtime.artifact import read_manifest
    from llmc.runtime.layers.rotary import check_rotary_device

    out = tmp_path / "a"
    build(recipe_from_dict({"model": str(partial_phi3("default")), "output": str(out), "dtype": "float32",
                            "target": {"device": "cpu"}, "runtime": {"max_model_len": 64}}), show_progress=False)
    model = read_manifest(out).model
    with pytest.raises(ConfigError, match=re.escape(
            "Phi3ForCausalLM: partial_rotary_factor (rotary on 16 of head_dim 32's dims) is not supported on CUDA, "
            "whose kernels rotate whole heads; it runs on a CPU: build with target.device cpu (llmc run --device cpu) "
            "or onnx-cpu")):
        check_rotary_device(model, torch.device("cuda"))
    check_rotary_device(model, torch.device("cpu"))
    whole = dataclasses.replace(model, rotary_dim=None)
    assert (whole.rotary_dims, whole.is_partial_rotary) == (32, False)
    check_rotary_device(whole, torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_partial_rotary_engine_refuses_cuda_on_a_gpu(partial_phi3, tmp_path, free_gpu):
    """On a real GPU: LLM(device="cuda") on a partial-rotary artifact stops with the one line, before the weights."""
    out = tmp_path / "a"
    build(recipe_from_dict({"model": str(partial_phi3("default")), "output": str(out), "dtype": "float32",
                            "target": {"device": "cpu"}, "runtime": {"max_model_len": 64}}), show_progress=False)
    with pytest.raises(ConfigError, match="partial_rotary_factor .* is not supported on CUDA"):
        LLM(out, device="cuda", gpu_memory_utilization=0.3)


def test_partial_rotary_factor_exports_and_reads_back(partial_phi3):
    """export's config.json says partial_rotary_factor (Phi-4-mini's top-level key), and LongRoPE's
    original_max_position_embeddings where Phi3Config reads it: transformers and the build read them back."""
    from transformers import Phi3Config

    from llmc.compiler.export import hf_config_of
    from llmc.compiler.hf_checkpoint import model_config_from_hf, model_spec_for, read_hf_config

    for rope in PARTIAL_ROPES:
        checkpoint = partial_phi3(rope)
        config = read_hf_config(checkpoint)
        ours = model_config_from_hf(config, model_spec_for(config, checkpoint), "float32")
        exported = hf_config_of(ours)
        assert exported["partial_rotary_factor"] == 0.5
        assert model_config_from_hf(exported, model_spec_for(exported, checkpoint), "float32") == ours
        theirs = Phi3Config(**exported).rope_parameters
        assert theirs["partial_rotary_factor"] == 0.5
        if rope == "longrope":  # the original context (64 here) said at the top level, where Phi3Config reads it
            assert theirs["original_max_position_embeddings"] == 64


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_other_families_ignore_partial_rotary_factor_as_transformers(family, hf_checkpoint_factory, tmp_path):
    """Llama's and Qwen2's transformers models rotate whole heads whatever partial_rotary_factor a config carries
    (their default rope computes head_dim / 2 frequencies): so does the build."""
    from transformers import AutoModelForCausalLM

    from llmc.compiler.hf_checkpoint import model_config_from_hf, model_spec_for, read_hf_config

    checkpoint = hf_checkpoint_factory(tmp_path / "ckpt", family, tokenizer=False)
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "partial_rotary_factor": 0.5}))
    theirs = AutoModelForCausalLM.from_pretrained(str(checkpoint)).model.rotary_emb.inv_freq
    config = read_hf_config(checkpoint)
    ours = model_config_from_hf(config, model_spec_for(config, checkpoint), "float32")
    assert (ours.rotary_dim, ours.rotary_dims, theirs.numel()) == (None, ours.head_dim, ours.head_dim // 2)


def test_onnx_refuses_rotated_dims_grouped_query_attention_does_not_take(tiny_phi3, tmp_path):
    """onnxruntime's GroupQueryAttention rotates 2 x its cos_cache width dims, a width that must be a multiple of 8:
    8 rotated dims (factor 0.25 of 32) are refused by name before any work; target cpu takes them."""
    checkpoint = _with_config(tiny_phi3, tmp_path / "ckpt", partial_rotary_factor=0.25, rope_parameters=None,
                              rope_theta=1e4, rope_scaling=None)
    said = ("target.device onnx-cpu: Phi3ForCausalLM rotates 8 of each head's 32 dims; onnxruntime's "
            "GroupQueryAttention rotates a multiple of 16")
    with pytest.raises(RecipeError, match=re.escape(said)):
        build(recipe_from_dict({"model": str(checkpoint), "output": str(tmp_path / "a"),
                                "target": {"device": "onnx-cpu"}}), show_progress=False)
    assert not (tmp_path / "a").exists()
