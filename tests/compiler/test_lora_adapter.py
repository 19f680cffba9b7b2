"""PEFT LoRA adapters merged at build time (the recipe's `adapter`): the artifact computes what transformers
computes on weights merged independently here (float64 W + scale·B·A), PEFT's own merge agrees with that
reference, a quantized build quantizes the merged weights, and what is not merged is refused by name."""

import json
import math
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from click.testing import CliRunner

from llmc.cli import cli
from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import RecipeError
from llmc.runtime import artifact as art
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

PROMPT = "What light through yonder window breaks? It is the east"
PREFIX = "base_model.model."

# Layer 1's q/v/down only (layers_to_transform), ranks and alphas per module from the patterns.
PATTERNS = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"],
            "layers_to_transform": [1], "rank_pattern": {"down_proj": 2}, "alpha_pattern": {r"self_attn\.v_proj": 3}}
# Every layer's k/o/gate/up by a regex, rsLoRA scaling.
RSLORA = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "use_rslora": True,
          "target_modules": r"model\.layers\.\d+\.(self_attn\.(k|o)_proj|mlp\.(gate|up)_proj)"}


def _config(fields: dict) -> dict:
    """adapter_config.json as PEFT writes it: its defaults, then `fields`."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None, "bias": "none",
            "fan_in_fan_out": False, "lora_dropout": 0.0, "modules_to_save": None, "use_dora": False,
            "use_rslora": False, "init_lora_weights": True, "layers_to_transform": None, "layers_pattern": None,
            "rank_pattern": {}, "alpha_pattern": {}, "inference_mode": True, **fields}


def _targeted(fields: dict, shapes: dict) -> dict[str, tuple[int, float]]:
    """{module: (r, scale)} the test's own reading of PEFT's rules, for the configs above."""
    out = {}
    for module in shapes:
        targets, layer = fields["target_modules"], int(module.split(".")[2])
        if isinstance(targets, str):
            if not re.fullmatch(targets, module):
                continue
        elif module.split(".")[-1] not in targets or layer not in (fields.get("layers_to_transform") or [layer]):
            continue
        pick = lambda patterns, default: next((v for k, v in patterns.items() if re.search(rf"(^|\.){k}$", module)), default)  # noqa: E731
        r, alpha = pick(fields.get("rank_pattern", {}), fields["r"]), pick(fields.get("alpha_pattern", {}), fields["lora_alpha"])
        out[module] = (r, alpha / (math.sqrt(r) if fields.get("use_rslora") else r))
    return out


def _linear_shapes(checkpoint) -> dict[str, tuple[int, int]]:
    tensors = load_file(checkpoint / "model.safetensors")
    return {n[: -len(".weight")]: tuple(t.shape) for n, t in tensors.items() if n.startswith("model.layers.") and t.dim() == 2}


def _write_adapter(path, checkpoint, fields: dict, seed: int, config: dict | None = None, extra: dict | None = None):
    """A PEFT LoRA directory, written in PEFT's format: lora_A [r, in] and lora_B [out, r] per targeted module."""
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (r, _) in _targeted(fields, _linear_shapes(checkpoint)).items():
        out_features, in_features = _linear_shapes(checkpoint)[module]
        tensors[f"{PREFIX}{module}.lora_A.weight"] = 0.3 * torch.randn(r, in_features, generator=gen)
        tensors[f"{PREFIX}{module}.lora_B.weight"] = 0.3 * torch.randn(out_features, r, generator=gen)
    save_file({**tensors, **(extra or {})}, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    (path / "adapter_config.json").write_text(json.dumps(config if config is not None else _config(fields)))
    return path


def _merged_checkpoint(path, checkpoint, adapters: list[tuple], dtype=torch.float64) -> object:
    """`checkpoint` with each (adapter dir, fields) merged in order, in `dtype`, written as float32. In float32
    the sum is PEFT's: W += (B @ A) * scale."""
    shutil.copytree(checkpoint, path)
    tensors = load_file(checkpoint / "model.safetensors")
    merged = {n: t.to(dtype) for n, t in tensors.items()}
    for adapter, fields in adapters:
        factors = load_file(adapter / "adapter_model.safetensors")
        for module, (_, scale) in _targeted(fields, _linear_shapes(checkpoint)).items():
            a, b = (factors[f"{PREFIX}{module}.lora_{f}.weight"].to(dtype) for f in "AB")
            merged[module + ".weight"] += (b @ a) * scale
    save_file({n: t.float() for n, t in merged.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _build(checkpoint, out, adapter=None, **extra):
    recipe = {"model": str(checkpoint), "output": str(out), "dtype": "float32", "runtime": {"max_model_len": 128}, **extra}
    if adapter is not None:
        recipe["adapter"] = adapter
    build(recipe_from_dict(recipe), show_progress=False)
    return out


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    patterns = _write_adapter(root / "patterns", tiny_llama, PATTERNS, seed=1)
    rslora = _write_adapter(root / "rslora", tiny_llama, RSLORA, seed=2)
    both = [(patterns, PATTERNS), (rslora, RSLORA)]
    return {"patterns": patterns, "rslora": rslora, "root": root,
            "merged_both": _merged_checkpoint(root / "merged_both", tiny_llama, both),
            "merged_both_f32": _merged_checkpoint(root / "merged_both_f32", tiny_llama, both, torch.float32)}


def test_merged_build_matches_transformers_on_merged_weights(tiny_llama, adapters, hf_logits, hf_encode, hf_greedy):
    """Two adapters, merged in order (rank/alpha patterns and layers_to_transform; a regex and rsLoRA), give the
    logits and greedy tokens of transformers on the independently merged checkpoint, and the manifest names them."""
    root, reference = adapters["root"], adapters["merged_both"]
    artifact = _build(tiny_llama, root / "art_both", [str(adapters["patterns"]), str(adapters["rslora"])])
    token_ids = hf_encode(reference, PROMPT) + list(range(100, 130))
    with LLM(artifact, device="cpu") as llm:
        ours = llm.engine.score(token_ids)
        torch.testing.assert_close(ours, hf_logits(reference, token_ids), atol=1e-4, rtol=1e-4)
        assert (ours - hf_logits(tiny_llama, token_ids)).abs().max() > 0.5  # the adapters change the model
        ids = hf_encode(reference, PROMPT)
        got = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=24))[0].outputs[0].token_ids
    assert got == hf_greedy(reference, PROMPT, 24)[0]
    source = art.read_manifest(artifact).source
    assert [a["path"] for a in source["adapters"]] == [str(adapters["patterns"]), str(adapters["rslora"])]
    assert source["adapters"][0]["sha256"]["adapter_model.safetensors"] == art.sha256_file(
        adapters["patterns"] / "adapter_model.safetensors")


def test_peft_merges_these_adapters_as_the_reference_does(tiny_llama, adapters, tmp_path):
    """PEFT itself (merge_and_unload) reads the hand-written adapters as the test's float64 merge does: the format
    and the rules (rank/alpha patterns, layers_to_transform, regex target_modules, rsLoRA) are PEFT's."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    for name in ("patterns", "rslora"):
        model = peft.PeftModel.from_pretrained(model, str(adapters[name])).merge_and_unload()
    reference = load_file(adapters["merged_both"] / "model.safetensors")
    state = model.state_dict()
    for name, want in reference.items():
        torch.testing.assert_close(state[name], want, atol=2e-6, rtol=1e-5, msg=name)


def test_an_adapter_saved_by_peft_builds_peft_merged_model(tiny_llama, tmp_path, hf_encode):
    """An adapter as PEFT's save_pretrained writes it (every key of its config) builds what merge_and_unload makes."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=6, target_modules=["q_proj", "o_proj", "up_proj"], layers_to_transform=[0],
                             rank_pattern={"up_proj": 2}, task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:  # lora_B starts at zero: give the adapter something to merge
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(tmp_path / "adapter")
    token_ids = hf_encode(tiny_llama, PROMPT)
    with torch.no_grad():
        want = model.merge_and_unload()(torch.tensor([token_ids])).logits[0]
    with LLM(_build(tiny_llama, tmp_path / "a", str(tmp_path / "adapter")), device="cpu") as llm:
        torch.testing.assert_close(llm.engine.score(token_ids), want, atol=1e-4, rtol=1e-4)


def test_rtn_build_quantizes_the_merged_weights(tiny_llama, adapters, hf_encode):
    """RTN of the adapter build is RTN of the merged checkpoint (merged in float32 as PEFT does: RTN's scales
    are absmax / 7, and a float64 merge differs in the last bit, enough to move a rounding), not of the base."""
    root = adapters["root"]
    rtn = {"quantization": {"method": "rtn", "bits": 4, "group_size": 32}}
    merged = _build(tiny_llama, root / "rtn_adapter", [str(adapters["patterns"]), str(adapters["rslora"])], **rtn)
    of_reference = _build(adapters["merged_both_f32"], root / "rtn_reference", **rtn)
    plain = _build(tiny_llama, root / "rtn_plain", **rtn)
    ours, reference, base = (load_file(a / "rank-00/weights.safetensors") for a in (merged, of_reference, plain))
    assert ours.keys() == reference.keys()
    for name in ours:
        assert torch.equal(ours[name], reference[name]), name
    assert torch.equal(ours["layers.0.mlp.down.qweight"], base["layers.0.mlp.down.qweight"])  # layer 1's only
    assert not torch.equal(ours["layers.1.mlp.down.qweight"], base["layers.1.mlp.down.qweight"])
    token_ids = hf_encode(tiny_llama, PROMPT)
    scores = []
    for artifact in (merged, plain):
        with LLM(artifact, device="cpu") as llm:
            scores.append(llm.engine.score(token_ids))
    assert (scores[0] - scores[1]).abs().max() > 0.5


def test_cli_adapter_flag_and_inspect(tiny_llama, adapters, tmp_path):
    """`llmc build --adapter` replaces the recipe's adapter; `llmc inspect` names it."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {tiny_llama}\noutput: {tmp_path / 'a'}\ndtype: float32\nruntime: {{max_model_len: 64}}\n"
                      f"adapter: {tmp_path / 'absent'}\n")
    refused = CliRunner().invoke(cli, ["build", "-q", str(recipe), "--adapter", str(adapters["rslora"])])
    assert isinstance(refused.exception, RecipeError) and "absent' does not exist" in str(refused.exception)  # read first
    recipe.write_text(recipe.read_text().replace(str(tmp_path / "absent"), str(adapters["patterns"])))
    built = CliRunner().invoke(cli, ["build", "-q", str(recipe), "--adapter", str(adapters["rslora"])])
    assert built.exit_code == 0, built.output
    assert [a["path"] for a in art.read_manifest(tmp_path / "a").source["adapters"]] == [str(adapters["rslora"])]
    shown = CliRunner().invoke(cli, ["inspect", str(tmp_path / "a")])
    assert shown.exit_code == 0 and re.search(rf"^adapter +{re.escape(str(adapters['rslora']))} \(sha256 ", shown.output, re.M)


def _refused(tiny_llama, tmp_path, fields=None, config=None, extra=None, adapter_fn=None, **recipe):
    adapter = tmp_path / "adapter"
    if adapter_fn is not None:
        adapter_fn(adapter)
    else:
        base = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}
        fields = {**base, **(fields or {})}
        _write_adapter(adapter, tiny_llama, fields, seed=0,
                       config=None if config is None else {**_config(fields), **config}, extra=extra)
    with pytest.raises(RecipeError) as info:
        _build(recipe.pop("model", tiny_llama), tmp_path / "out", str(adapter), **recipe)
    assert "\n" not in str(info.value) and not (tmp_path / "out").exists()
    return str(info.value)


A1 = f"{PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize("config,extra,words", [
    ({"use_dora": True}, None, "use_dora: DoRA"),
    ({"fan_in_fan_out": True}, None, "fan_in_fan_out true"),
    ({"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    ({"bias": "all"}, None, "bias 'all'"),
    ({"lora_bias": True}, None, "lora_bias"),
    ({"peft_type": "IA3"}, None, "peft_type 'IA3' is not merged"),
    ({"peft_type": "LOHA"}, None, "peft_type 'LOHA'"),
    ({"init_lora_weights": "pissa"}, None, "init_lora_weights 'pissa'"),
    ({"target_modules": ["q_proj", "c_attn"]}, None, "names 'c_attn', which this model does not have"),
    ({"target_modules": r".*\.nothing"}, None, "matches no module of this model"),
    ({"target_modules": r".*q_proj", "layers_to_transform": [0]}, None, "layers_to_transform applies to a list"),
    (None, {f"{PREFIX}model.embed_tokens.lora_embedding_A": torch.zeros(2, 4096)}, "LoRA on an embedding"),
    (None, {f"{PREFIX}model.layers.0.self_attn.q_proj.lora_magnitude_vector": torch.zeros(64)}, "DoRA magnitude"),
    (None, {f"{PREFIX}model.layers.0.self_attn.q_proj.lora_B.bias": torch.zeros(64)}, "a LoRA bias"),
    (None, {f"{PREFIX}model.layers.0.self_attn.k_proj.lora_A.weight": torch.zeros(2, 64),
            f"{PREFIX}model.layers.0.self_attn.k_proj.lora_B.weight": torch.zeros(32, 2)}, "do not select"),
    (None, {A1: torch.zeros(2, 32)}, "the adapter was trained on another base model"),
    (None, {A1: torch.zeros(3, 64)}, "are not of rank 2"),
])
def test_what_is_not_merged_is_refused_by_name(tiny_llama, tmp_path, config, extra, words):
    assert words in _refused(tiny_llama, tmp_path, config=config, extra=extra)


def test_lm_head_target_is_refused(tiny_llama, tmp_path):
    def write(path):
        path.mkdir()
        save_file({f"{PREFIX}lm_head.lora_A.weight": torch.zeros(2, 64), f"{PREFIX}lm_head.lora_B.weight": torch.zeros(4096, 2)},
                  str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps(_config({"r": 2, "lora_alpha": 2, "target_modules": ["lm_head"]})))
    assert "not the embedding or lm_head" in _refused(tiny_llama, tmp_path, adapter_fn=write)


def test_moe_expert_target_is_refused(tiny_mixtral, tmp_path):
    def write(path):
        path.mkdir()
        module = "model.layers.0.block_sparse_moe.experts.0.w1"
        save_file({f"{PREFIX}{module}.lora_A.weight": torch.zeros(2, 64), f"{PREFIX}{module}.lora_B.weight": torch.zeros(96, 2)},
                  str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps(_config({"r": 2, "lora_alpha": 2, "target_modules": ["w1"]})))
    assert "mixture-of-experts experts" in _refused(tiny_mixtral, tmp_path, adapter_fn=write, model=tiny_mixtral)


def test_pickle_adapter_and_missing_files_are_refused(tiny_llama, tmp_path):
    def pickle_only(path):
        path.mkdir()
        (path / "adapter_config.json").write_text(json.dumps(_config({"r": 2, "lora_alpha": 2, "target_modules": ["q_proj"]})))
        (path / "adapter_model.bin").write_bytes(b"not read")
    assert "adapter_model.bin is a pickle" in _refused(tiny_llama, tmp_path, adapter_fn=pickle_only)
    with pytest.raises(RecipeError, match="adapter: '.*nowhere' does not exist"):
        _build(tiny_llama, tmp_path / "o", str(tmp_path / "nowhere"))


def test_pre_quantized_checkpoint_takes_no_adapter(tiny_llama, tmp_path):
    quantized = tmp_path / "gptq"
    shutil.copytree(tiny_llama, quantized)
    config = json.loads((quantized / "config.json").read_text())
    qconfig = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": qconfig}))
    for method in ("import", "rtn"):
        words = _refused(tiny_llama, tmp_path / method, model=quantized, quantization={"method": method})
        assert "cannot be merged into packed quantized weights" in words
