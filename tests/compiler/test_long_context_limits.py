"""Long-context limits read as transformers and vLLM read them: the longest max_model_len a rope scaling
supports (vLLM's _get_and_verify_max_len), and the config class defaults of keys a config.json leaves out."""

import json

import pytest
import torch

from llmc.compiler.build import build
from llmc.compiler.hf_checkpoint import model_config_from_hf
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ConfigError, RecipeError
from llmc.runtime.layers.rotary import model_context
from llmc.runtime.models import spec_for_architecture


def _model(config: dict):
    return model_config_from_hf(config, spec_for_architecture(config["architectures"][0]), "float32")


def _config(arch: str, model_type: str, **extra) -> dict:
    return {"architectures": [arch], "model_type": model_type, "vocab_size": 64, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, **extra}


@pytest.mark.parametrize("rope,limit", [
    (None, 1024),
    ({"rope_type": "linear", "factor": 4.0}, 4096),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 128}, 1024),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}, 2048),
])
def test_max_context_len_per_rope_type(rope, limit):
    assert model_context(1024, rope)[0] == limit


def test_a_max_model_len_past_the_yarn_context_is_refused(hf_checkpoint_factory, tmp_path):
    checkpoint = hf_checkpoint_factory(tmp_path / "ckpt", "qwen2", max_position_embeddings=256, rope_parameters={
        "rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})
    recipe = {"model": str(checkpoint), "output": str(tmp_path / "a"), "dtype": "float32"}
    with pytest.raises(RecipeError, match="exceeds the model's context of 512"):
        build(recipe_from_dict({**recipe, "runtime": {"max_model_len": 1_000_000}}), show_progress=False)
    build(recipe_from_dict({**recipe, "runtime": {"max_model_len": 512}}), show_progress=False)
    # vLLM's default is that context too (original 128 x 4), not max_position_embeddings (256)
    build(recipe_from_dict({**recipe, "output": str(tmp_path / "b")}), show_progress=False)
    from llmc.runtime.artifact import read_manifest
    assert read_manifest(tmp_path / "b").runtime.max_model_len == 512

    from llmc.runtime.llm import LLM
    with pytest.raises(ConfigError, match="exceeds the model's context of 512"):
        LLM(tmp_path / "a", device="cpu", max_model_len=513)
    with LLM(tmp_path / "a", device="cpu", max_model_len=None, num_kv_blocks=32) as llm:
        assert llm.engine.options.max_model_len == 512


def test_missing_keys_take_the_transformers_class_defaults():
    mistral = _model(_config("MistralForCausalLM", "mistral"))
    assert (mistral.max_position_embeddings, mistral.sliding_window) == (131072, 4096)
    assert _model(_config("MistralForCausalLM", "mistral", sliding_window=None)).sliding_window is None
    qwen = _model(_config("Qwen2ForCausalLM", "qwen2", sliding_window=16, max_window_layers=0,
                          rope_scaling={"type": "yarn", "factor": 4.0}))
    assert qwen.sliding_window is None  # use_sliding_window defaults to False
    assert qwen.rope_scaling["original_max_position_embeddings"] == 32768
    assert _model(_config("LlamaForCausalLM", "llama")).max_position_embeddings == 2048


@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_a_window_without_use_sliding_window_is_ignored_as_transformers_does(hf_checkpoint_factory, tmp_path,
                                                                             hf_logits, family):
    checkpoint = hf_checkpoint_factory(tmp_path / "ckpt", family)
    path = checkpoint / "config.json"
    cfg = json.loads(path.read_text())
    for key in ("layer_types", "use_sliding_window"):
        cfg.pop(key, None)
    cfg.update(sliding_window=16, max_window_layers=0)
    path.write_text(json.dumps(cfg))
    out = tmp_path / "artifact"
    build(recipe_from_dict({"model": str(checkpoint), "output": str(out), "dtype": "float32",
                            "runtime": {"max_model_len": 128}}), show_progress=False)
    from llmc.runtime.llm import LLM
    token_ids = list(range(5, 85))
    torch.testing.assert_close(LLM(out, device="cpu").engine.score(token_ids), hf_logits(checkpoint, token_ids),
                               atol=1e-4, rtol=1e-4)
