"""Checks of the tiny-checkpoint fixtures and the transformers oracle in tests/conftest.py."""

from __future__ import annotations

import json
import logging
import warnings

import pytest
import torch
from safetensors import safe_open

FAMILIES = ("llama", "llama3_rope", "mistral", "qwen2", "qwen3", "phi3")
ARCH = {
    "llama": "LlamaForCausalLM",
    "llama3_rope": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
PROMPT = "ROMEO:"


def read_tensors(path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, from the single file or from all shards of the index."""
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    out = {}
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            for key in f.keys():
                assert key not in out, f"{key} stored twice"
                out[key] = f.get_tensor(key)
    return out


def read_config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_every_family_has_a_fixture(request):
    import transformers

    for family in FAMILIES:
        path = request.getfixturevalue(f"tiny_{family}")
        assert read_config(path)["architectures"] == [ARCH[family]]
        assert transformers.__version__.startswith("5."), "the config key checks below assume transformers 5"


def test_common_config_and_files(tiny_checkpoint, hf_model):
    family, path = tiny_checkpoint
    cfg = read_config(path)
    for name in ("config.json", "generation_config.json", "model.safetensors",
                 "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (path / name).is_file(), name
    assert cfg["architectures"] == [ARCH[family]]
    assert cfg["hidden_size"] == 64 and cfg["intermediate_size"] == 128
    assert cfg["num_hidden_layers"] == 2
    assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == 2  # GQA
    assert cfg["vocab_size"] == 4096
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (0, 1)
    assert cfg["max_position_embeddings"] == 256
    assert cfg["rms_norm_eps"] == 1e-6
    assert cfg["dtype"] == "float32"
    # transformers 5 writes rope_parameters only, never the legacy keys.
    assert "rope_parameters" in cfg and "rope_theta" not in cfg and "rope_scaling" not in cfg
    assert cfg["rope_parameters"]["rope_theta"] == (1e6 if family == "qwen2" else 1e4)

    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["do_sample"] is False and gen["eos_token_id"] == 1

    tensors = read_tensors(path)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    model = hf_model(path)  # loads in transformers, no missing / unexpected keys
    assert type(model).__name__ == ARCH[family]
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    if family == "phi3":  # q, k, v fused: rows 4 heads + 2 + 2 of head_dim 32
        assert tensors["model.layers.0.self_attn.qkv_proj.weight"].shape == ((4 + 2 + 2) * 32, 64)
    else:
        k = tensors["model.layers.0.self_attn.k_proj.weight"]
        q = tensors["model.layers.0.self_attn.q_proj.weight"]
        assert k.shape[0] * 2 == q.shape[0]


def test_norms_and_biases_are_random(tiny_checkpoint):
    family, path = tiny_checkpoint
    tensors = read_tensors(path)
    norms = {k: v for k, v in tensors.items() if "norm" in k}
    # 2 per layer + final (+ q_norm, k_norm per layer for qwen3)
    assert len(norms) == (2 * 2 + 1 + (4 if family == "qwen3" else 0))
    for name, w in norms.items():
        assert not torch.allclose(w, torch.ones_like(w), atol=1e-3), name
        assert abs(w.mean().item() - 1.0) < 0.1 and 0.03 < w.std().item() < 0.3, name
    biases = {k: v for k, v in tensors.items() if k.endswith(".bias")}
    if family == "qwen2":
        assert sorted({k.split(".")[-2] for k in biases}) == ["k_proj", "q_proj", "v_proj"]
        assert len(biases) == 6
        for name, b in biases.items():
            assert b.abs().min() > 0 and 0.03 < b.std().item() < 0.3, name
    else:
        assert not biases


def test_qwen2_specifics(tiny_qwen2):
    cfg = read_config(tiny_qwen2)
    assert cfg["tie_word_embeddings"] is True
    tensors = read_tensors(tiny_qwen2)
    assert "lm_head.weight" not in tensors  # tied: save_pretrained drops it
    assert tensors["model.layers.0.self_attn.q_proj.bias"].shape == (64,)
    assert tensors["model.layers.0.self_attn.k_proj.bias"].shape == (32,)


def test_qwen3_specifics(tiny_qwen3):
    cfg = read_config(tiny_qwen3)
    assert cfg["head_dim"] == 32 != cfg["hidden_size"] // cfg["num_attention_heads"]
    t = read_tensors(tiny_qwen3)
    assert t["model.layers.0.self_attn.q_proj.weight"].shape == (128, 64)
    assert t["model.layers.0.self_attn.k_proj.weight"].shape == (64, 64)
    assert t["model.layers.0.self_attn.o_proj.weight"].shape == (64, 128)
    assert t["model.layers.0.self_attn.q_norm.weight"].shape == (32,)
    assert t["model.layers.1.self_attn.k_norm.weight"].shape == (32,)
    assert "lm_head.weight" in t


def test_phi3_specifics(tiny_phi3):
    cfg = read_config(tiny_phi3)
    assert cfg["model_type"] == "phi3" and cfg["sliding_window"] is None and cfg["head_dim"] == 32
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}
    t = read_tensors(tiny_phi3)
    layer = {k.removeprefix("model.layers.0."): tuple(v.shape) for k, v in t.items() if k.startswith("model.layers.0.")}
    assert layer == {"self_attn.qkv_proj.weight": (256, 64), "self_attn.o_proj.weight": (64, 128),
                     "mlp.gate_up_proj.weight": (256, 64), "mlp.down_proj.weight": (64, 128),
                     "input_layernorm.weight": (64,), "post_attention_layernorm.weight": (64,)}
    assert "lm_head.weight" in t


def test_mistral_specifics(tiny_mistral):
    cfg = read_config(tiny_mistral)
    assert cfg["model_type"] == "mistral" and cfg["sliding_window"] is None
    assert cfg["head_dim"] == 16


def test_llama3_rope_scaling(tiny_llama3_rope, tiny_llama, hf_model, hf_logits, hf_encode):
    rope = read_config(tiny_llama3_rope)["rope_parameters"]
    assert rope == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 10000.0,
    }
    # Same weights as tiny_llama; only the rope differs.
    a, b = read_tensors(tiny_llama), read_tensors(tiny_llama3_rope)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    plain = hf_model(tiny_llama).model.rotary_emb.inv_freq
    scaled = hf_model(tiny_llama3_rope).model.rotary_emb.inv_freq
    assert plain.shape == scaled.shape == (8,)
    kept = torch.isclose(scaled, plain)
    divided = torch.isclose(scaled, plain / 8)
    smoothed = ~kept & ~divided
    assert kept.any() and divided.any() and smoothed.any(), (plain, scaled)
    ids = hf_encode(tiny_llama, "The quick brown fox jumps over the lazy dog. " * 3)
    assert not torch.allclose(hf_logits(tiny_llama, ids), hf_logits(tiny_llama3_rope, ids), atol=1e-3)


def test_sharded_checkpoint(tiny_llama_sharded, tiny_llama, hf_logits, hf_encode):
    files = sorted(p.name for p in tiny_llama_sharded.glob("*.safetensors"))
    assert len(files) >= 3 and "model.safetensors" not in files
    assert all(f.startswith("model-") and f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    index = json.loads((tiny_llama_sharded / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == files
    sharded, single = read_tensors(tiny_llama_sharded), read_tensors(tiny_llama)
    assert set(index["weight_map"]) == set(sharded) == set(single)
    assert all(torch.equal(sharded[k], single[k]) for k in single)
    ids = hf_encode(tiny_llama, PROMPT)
    assert torch.equal(hf_logits(tiny_llama_sharded, ids), hf_logits(tiny_llama, ids))


@pytest.mark.parametrize("family", FAMILIES)
def test_legacy_rope_keys_give_identical_logits(family, tmp_path, hf_checkpoint_factory,
                                                hf_logits, hf_encode, request):
    modern = request.getfixturevalue(f"tiny_{family}")
    legacy = hf_checkpoint_factory(tmp_path / family, family, legacy_rope_keys=True)
    cfg = read_config(legacy)
    assert "rope_parameters" not in cfg
    assert cfg["rope_theta"] == read_config(modern)["rope_parameters"]["rope_theta"]
    if family == "llama3_rope":
        assert cfg["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    else:
        assert cfg["rope_scaling"] is None
    a, b = read_tensors(legacy), read_tensors(modern)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = hf_encode(modern, "Once upon a time, in a land far away, there lived")
    assert torch.equal(hf_logits(legacy, ids), hf_logits(modern, ids))


def test_legacy_type_spelling(tmp_path, tiny_llama3_rope, hf_checkpoint_factory, hf_logits, hf_encode):
    legacy = hf_checkpoint_factory(tmp_path / "l3", "llama3_rope", legacy_rope_keys="type")
    assert read_config(legacy)["rope_scaling"]["type"] == "llama3"
    ids = hf_encode(tiny_llama3_rope, "Once upon a time, in a land far away, there lived")
    assert torch.equal(hf_logits(legacy, ids), hf_logits(tiny_llama3_rope, ids))


def test_greedy_is_non_degenerate_and_matches_logits(tiny_checkpoint, hf_greedy, hf_logits, hf_encode):
    family, path = tiny_checkpoint
    [new] = hf_greedy(path, [PROMPT], 48)
    assert len(new) == 48
    assert len(set(new)) > 8, f"{family}: greedy collapsed: {new}"
    prompt_ids = hf_encode(path, PROMPT)
    assert prompt_ids[0] == 0  # bos prepended by the tokenizer
    logits = hf_logits(path, prompt_ids + new)
    assert logits.shape == (len(prompt_ids) + 48, 4096) and logits.dtype == torch.float32
    # teacher-forced argmax = the generated tokens, so the two oracles agree
    assert logits[len(prompt_ids) - 1:-1].argmax(-1).tolist() == new
    assert logits.std(-1).mean() > 1.5  # logits far from all-equal


def test_greedy_batch_of_prompts(tiny_llama, hf_greedy):
    prompts = [PROMPT, "Hello", "The quick brown fox"]
    outs = hf_greedy(tiny_llama, prompts, 8)
    assert [len(o) for o in outs] == [8, 8, 8]
    assert outs[0] == hf_greedy(tiny_llama, [PROMPT], 8)[0]  # no padding effects
    assert len({tuple(o) for o in outs}) == 3


def test_greedy_stops_at_eos(tmp_path, tiny_llama, hf_checkpoint_factory, hf_greedy):
    [ref] = hf_greedy(tiny_llama, [PROMPT], 16)
    eos = ref[5]
    first = ref.index(eos)
    # same family and seed -> same weights; only the eos id differs
    path = hf_checkpoint_factory(tmp_path / "eos", "llama", eos_token_id=eos)
    [new] = hf_greedy(path, [PROMPT], 16)
    assert new == ref[: first + 1]  # eos included, then stop


def test_generate_emits_no_warnings(tmp_path, hf_checkpoint_factory, hf_greedy):
    path = hf_checkpoint_factory(tmp_path / "w", "qwen2", seed=3)
    records: list[logging.LogRecord] = []

    class Grab(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Grab(level=logging.WARNING)
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hf_greedy(path, [PROMPT], 4)
    finally:
        logger.removeHandler(handler)
    caught = [w for w in caught if not issubclass(w.category, ResourceWarning)]
    assert not caught, [str(w.message) for w in caught]
    assert not records, [r.getMessage() for r in records]


def test_seeds(tmp_path, tiny_llama, tiny_mistral, hf_checkpoint_factory):
    again = read_tensors(hf_checkpoint_factory(tmp_path / "a", "llama", seed=0))
    other = read_tensors(hf_checkpoint_factory(tmp_path / "b", "llama", seed=1))
    ref = read_tensors(tiny_llama)
    key = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(again[key], ref[key]) and not torch.equal(other[key], ref[key])
    assert not torch.equal(read_tensors(tiny_mistral)[key], ref[key])  # families differ


def test_tokenizer_copied(tiny_qwen3, ref_model_dir):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tiny_qwen3 / name).read_bytes() == (ref_model_dir / name).read_bytes()


def test_dirs(repo_root, ref_model_dir, peer_checkpoint_dir):
    assert (repo_root / "pyproject.toml").is_file()
    assert ref_model_dir == repo_root / "checkpoints" / "ref-llama-12m"
    assert (ref_model_dir / "config.json").is_file()
    assert (peer_checkpoint_dir / "model.safetensors").is_file()  # shipped: no test reads ../shared


def test_ref_model_greedy(ref_model_dir, hf_greedy, hf_encode):
    """The oracle reproduces the README's greedy continuation of the trained reference model."""
    from transformers import AutoTokenizer

    [new] = hf_greedy(ref_model_dir, [PROMPT], 12)
    tok = AutoTokenizer.from_pretrained(str(ref_model_dir))
    text = tok.decode(hf_encode(ref_model_dir, PROMPT) + new, skip_special_tokens=True)
    assert text.startswith("ROMEO:\nI'll have a little more.")
