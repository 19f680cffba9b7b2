"""Our build + runtime against transformers' own model, for every supported family, dense and
mixture-of-experts (float32)."""

from pathlib import Path

import pytest
import torch

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

PROMPTS = [
    "ROMEO:",
    "The quick brown fox jumps over the lazy dog, and then",
    "In the beginning",
    "What light through yonder window breaks? It is the east",
    "A",
]
NUM_NEW_TOKENS = 48


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """Build (once per family) a float32 artifact of the tiny checkpoint."""
    cache: dict[Path, Path] = {}

    def get(checkpoint: Path, **runtime) -> Path:
        if checkpoint not in cache:
            out = tmp_path_factory.mktemp("artifact") / "a"
            recipe = recipe_from_dict({"model": str(checkpoint), "output": str(out), "dtype": "float32",
                                       "runtime": {"max_model_len": 256, **runtime}})
            build(recipe, show_progress=False)
            cache[checkpoint] = out
        return cache[checkpoint]

    return get


def test_greedy_matches_transformers_with_continuous_batching(tiny_any_checkpoint, artifacts, hf_greedy, hf_encode):
    family, checkpoint = tiny_any_checkpoint
    expected = hf_greedy(checkpoint, PROMPTS, NUM_NEW_TOKENS)
    # Fewer seats than prompts, and a small token budget: requests join as others finish,
    # and long prompts are prefilled in chunks beside running decodes.
    llm = LLM(artifacts(checkpoint), device="cpu", max_num_seqs=3, max_num_batched_tokens=16, num_kv_blocks=64)
    prompts = [{"prompt_token_ids": hf_encode(checkpoint, p)} for p in PROMPTS]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS))
    for prompt, want, got in zip(PROMPTS, expected, outputs):
        assert got.outputs[0].token_ids == want, f"{family}: {prompt!r}"
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_total_blocks"]


def test_text_prompts_are_tokenized_like_transformers(tiny_llama, artifacts, hf_greedy):
    expected = hf_greedy(tiny_llama, PROMPTS[:2], 16)
    llm = LLM(artifacts(tiny_llama), device="cpu")
    outputs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=16))
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert outputs[0].outputs[0].text == llm.tokenizer.decode(expected[0], skip_special_tokens=True)


def test_logits_match_transformers(tiny_any_checkpoint, artifacts, hf_logits, hf_encode):
    family, checkpoint = tiny_any_checkpoint
    token_ids = hf_encode(checkpoint, PROMPTS[3]) + list(range(100, 140))
    llm = LLM(artifacts(checkpoint), device="cpu")
    ours = llm.engine.score(token_ids)  # [len, vocab]
    theirs = hf_logits(checkpoint, token_ids)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4, msg=family)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_family_matches_transformers_on_the_gpu(tiny_any_checkpoint, artifacts, hf_greedy, hf_logits, hf_encode,
                                                      free_gpu):
    """The same float32 artifacts on CUDA (Triton attention, rotary, norm and SiLU kernels; CUDA graphs):
    transformers' greedy tokens and logits."""
    family, checkpoint = tiny_any_checkpoint
    expected = hf_greedy(checkpoint, PROMPTS, NUM_NEW_TOKENS)
    llm = LLM(artifacts(checkpoint), device="cuda", gpu_memory_utilization=0.3, max_num_seqs=3,
              max_num_batched_tokens=16)
    prompts = [{"prompt_token_ids": hf_encode(checkpoint, p)} for p in PROMPTS]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS))
    for prompt, want, got in zip(PROMPTS, expected, outputs):
        assert got.outputs[0].token_ids == want, f"{family}: {prompt!r}"
    token_ids = hf_encode(checkpoint, PROMPTS[3]) + list(range(100, 140))
    torch.testing.assert_close(llm.engine.score(token_ids).cpu(), hf_logits(checkpoint, token_ids), atol=2e-3,
                               rtol=2e-3, msg=family)
    llm.close()


def test_sharded_checkpoint_builds_the_same_weights(tiny_llama, tiny_llama_sharded, artifacts):
    from safetensors.torch import load_file

    one = load_file(artifacts(tiny_llama) / "rank-00" / "weights.safetensors")
    many = load_file(artifacts(tiny_llama_sharded) / "rank-00" / "weights.safetensors")
    assert one.keys() == many.keys()
    for name in one:
        assert torch.equal(one[name], many[name]), name


def test_legacy_rope_keys_read_the_same(hf_checkpoint_factory, tmp_path, hf_greedy, hf_encode):
    checkpoint = hf_checkpoint_factory(tmp_path / "legacy", "llama3_rope", legacy_rope_keys=True)
    out = tmp_path / "artifact"
    build(recipe_from_dict({"model": str(checkpoint), "output": str(out), "dtype": "float32"}), show_progress=False)
    expected = hf_greedy(checkpoint, PROMPTS[:1], 24)
    llm = LLM(out, device="cpu")
    got = llm.generate([{"prompt_token_ids": hf_encode(checkpoint, PROMPTS[0])}], SamplingParams(temperature=0, max_tokens=24))
    assert got[0].outputs[0].token_ids == expected[0]


def test_moe_layers_as_transformers_chooses_them(hf_checkpoint_factory, hf_model, tmp_path):
    """decoder_sparse_step and mlp_only_layers pick the same sparse layers as transformers' model."""
    from llmc.compiler.hf_checkpoint import model_config_from_hf, read_hf_config
    from llmc.runtime.models import qwen3_moe

    path = hf_checkpoint_factory(tmp_path / "q", "qwen3_moe", num_hidden_layers=6, decoder_sparse_step=2,
                                 mlp_only_layers=[3], tokenizer=False)
    model = model_config_from_hf(read_hf_config(path), qwen3_moe.SPEC, "float32")
    hf_sparse = [i for i, layer in enumerate(hf_model(path).model.layers) if hasattr(layer.mlp, "experts")]
    assert model.moe_layers == hf_sparse == [1, 5]
    assert model.norm_topk_prob is False


@pytest.mark.parametrize("family,rope,legacy", [
    ("qwen2", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, "type"),  # Qwen2.5's spelling
    ("qwen3", {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128, "beta_fast": 16,
               "beta_slow": 2, "attention_factor": 1.2}, False),
    ("llama", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "truncate": False}, True),
    ("mistral", {"rope_type": "linear", "factor": 2.0}, False),
    # no original context: transformers takes max_position_embeddings (the build raised a KeyError)
    ("llama", {"rope_type": "yarn", "factor": 4.0}, "type"),
], ids=["qwen2-yarn", "qwen3-yarn-explicit", "llama-yarn-untruncated", "mistral-linear", "llama-yarn-no-original"])
def test_scaled_ropes_match_transformers(hf_checkpoint_factory, tmp_path, hf_logits, family, rope, legacy):
    """YaRN (its frequency ramp and attention factor) and linear scaling, past the original context, as
    transformers computes them; published configs' key spellings included."""
    checkpoint = hf_checkpoint_factory(tmp_path / "ckpt", family, legacy_rope_keys=legacy,
                                       rope_parameters={"rope_theta": 10000.0, **rope})
    out = tmp_path / "artifact"
    build(recipe_from_dict({"model": str(checkpoint), "output": str(out), "dtype": "float32",
                            "runtime": {"max_model_len": 256}}), show_progress=False)
    token_ids = list(range(5, 205))  # 200 positions: beyond every original context above
    llm = LLM(out, device="cpu")
    torch.testing.assert_close(llm.engine.score(token_ids), hf_logits(checkpoint, token_ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family,window", [
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}),  # layer 1 slides
    ("qwen3", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}),  # every layer
    ("mistral", {"sliding_window": 16}),
    ("phi3", {"sliding_window": 16}),  # every layer (Phi-3-mini-4k's 2047)
], ids=["qwen2-upper-layers", "qwen3-all-layers", "mistral", "phi3"])
def test_sliding_windows_on_the_layers_transformers_gives_them(hf_checkpoint_factory, tmp_path, hf_logits,
                                                               family, window):
    """Qwen2/3's window applies from max_window_layers on (the config's layer_types); it was applied to every
    layer, and logprobs past the window differed by up to 8.5."""
    checkpoint = hf_checkpoint_factory(tmp_path / "ckpt", family, **window)
    out = tmp_path / "artifact"
    build(recipe_from_dict({"model": str(checkpoint), "output": str(out), "dtype": "float32",
                            "runtime": {"max_model_len": 128}}), show_progress=False)
    token_ids = list(range(5, 85))  # 80 positions: far past the window
    llm = LLM(out, device="cpu", max_num_batched_tokens=32)  # prefilled in chunks
    torch.testing.assert_close(llm.engine.score(token_ids), hf_logits(checkpoint, token_ids), atol=1e-4, rtol=1e-4)


def test_rope_scaling_without_the_keys_it_needs_is_one_line(ref_model_dir):
    """A rope_scaling entry missing a key its type reads is refused naming the key (was a KeyError
    traceback from the build); an unsupported type is refused by name."""
    from llmc.compiler.hf_checkpoint import model_config_from_hf, model_spec_for, read_hf_config
    from llmc.errors import CheckpointError

    config = read_hf_config(ref_model_dir)
    spec = model_spec_for(config, ref_model_dir)
    for scaling, message in [({"type": "yarn"}, "rope_scaling type 'yarn' needs factor"),
                             ({"rope_type": "llama3", "factor": 8.0}, "needs low_freq_factor, high_freq_factor"),
                             ({"rope_type": "dynamic", "factor": 2.0}, "rope_scaling type 'dynamic' is not supported")]:
        broken = {k: v for k, v in config.items() if k != "rope_parameters"} | {"rope_theta": 10000.0,
                                                                                "rope_scaling": scaling}
        with pytest.raises(CheckpointError, match=message):
            model_config_from_hf(broken, spec, "float32")


def test_which_layers_slide_by_family():
    """Dense Qwen2/3 read max_window_layers (when the config has no layer_types); Qwen3-MoE windows every
    layer whatever that key says, as transformers' Qwen3MoeAttention does."""
    from llmc.compiler.hf_checkpoint import _sliding_window

    config = {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2, "num_hidden_layers": 4}
    assert _sliding_window({**config, "model_type": "qwen2"}) == (8, [2, 3])
    assert _sliding_window({**config, "model_type": "qwen3_moe"}) == (8, None)
    assert _sliding_window({**config, "model_type": "qwen2", "layer_types": ["full_attention"] * 4}) == (None, None)
    assert _sliding_window({**config, "model_type": "qwen2", "use_sliding_window": False}) == (None, None)
