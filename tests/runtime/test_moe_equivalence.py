"""Mixture-of-experts models (Mixtral, Qwen3-MoE) built and run by llmc against transformers (float32)."""

import pytest
import torch

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

PROMPTS = ["ROMEO:", "The quick brown fox jumps over the lazy dog, and then", "In the beginning", "A"]
NUM_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def moe_artifacts(tmp_path_factory):
    cache = {}

    def get(checkpoint):
        if checkpoint not in cache:
            out = tmp_path_factory.mktemp("moe-artifact") / "a"
            build(recipe_from_dict({"model": str(checkpoint), "output": str(out), "dtype": "float32",
                                    "runtime": {"max_model_len": 256}}), show_progress=False)
            cache[checkpoint] = out
        return cache[checkpoint]

    return get


def test_moe_greedy_matches_transformers(tiny_moe_checkpoint, moe_artifacts, hf_greedy, hf_encode):
    family, checkpoint = tiny_moe_checkpoint
    expected = hf_greedy(checkpoint, PROMPTS, NUM_NEW_TOKENS)
    llm = LLM(moe_artifacts(checkpoint), device="cpu", max_num_seqs=3, max_num_batched_tokens=16, num_kv_blocks=64)
    prompts = [{"prompt_token_ids": hf_encode(checkpoint, p)} for p in PROMPTS]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS))
    for prompt, want, got in zip(PROMPTS, expected, outputs):
        assert got.outputs[0].token_ids == want, f"{family}: {prompt!r}"


def test_moe_logits_match_transformers(tiny_moe_checkpoint, moe_artifacts, hf_logits, hf_encode):
    family, checkpoint = tiny_moe_checkpoint
    token_ids = hf_encode(checkpoint, PROMPTS[1]) + list(range(100, 140))
    llm = LLM(moe_artifacts(checkpoint), device="cpu")
    torch.testing.assert_close(llm.engine.score(token_ids), hf_logits(checkpoint, token_ids), atol=1e-4, rtol=1e-4, msg=family)


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
