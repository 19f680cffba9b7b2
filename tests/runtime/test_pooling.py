"""Embeddings (runner pooling, runtime/pooling.py) against transformers: the final hidden states of
`AutoModelForCausalLM(...).model` (last_hidden_state), pooled and normalized in float64 here."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ConfigError, RequestError
from llmc.runtime.llm import LLM
from llmc.runtime.pooling import EmbeddingRequestOutput, PoolingParams
from llmc.runtime.sampling_params import SamplingParams

from tests.conftest import hf_encode, hf_model

LONG = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer " * 3
PROMPTS = ["ROMEO: what light through yonder window breaks?", "Hi", LONG, LONG[:120] + " the slings and arrows"]


@torch.inference_mode()
def reference(path, token_ids: list[int], pooling_type: str, normalize: bool = True) -> torch.Tensor:
    ids = torch.tensor([token_ids])
    hidden = hf_model(path).model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0].double()
    pooled = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling_type]
    return torch.nn.functional.normalize(pooled, dim=0) if normalize else pooled


def assert_close(output: EmbeddingRequestOutput, expected: torch.Tensor, atol: float) -> None:
    got = torch.tensor(output.outputs.embedding, dtype=torch.float64)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < atol, (got - expected).abs().max().item()


@pytest.mark.parametrize("pooling_type,device", [("LAST", "cpu"), ("MEAN", "cpu"),
                                                  pytest.param("CLS", "cpu", marks=pytest.mark.slow),
                                                  pytest.param("LAST", "cuda", marks=pytest.mark.gpu),
                                                  pytest.param("MEAN", "cuda", marks=pytest.mark.gpu)])
def test_embeddings_equal_transformers_hidden_states_pooled(ref_artifact_128, ref_model_dir, pooling_type, device):
    # chunks of 16 tokens: the long prompt's MEAN sums several chunks; the fourth prompt shares the third's
    # first blocks, which LAST reads from the prefix cache (MEAN and CLS must compute them). On a GPU the
    # steps replay the piecewise graphs, and a step of one-token prompts the decode graphs.
    with LLM(ref_artifact_128, device=device, runner="pooling", pooler_config={"pooling_type": pooling_type},
             max_num_batched_tokens=16, gpu_memory_utilization=0.3) as llm:
        outputs = llm.embed(PROMPTS)
        stats = llm.stats()
        singles = llm.embed([[1], [2]])
    for prompt, output in zip(PROMPTS, outputs):
        assert output.prompt_token_ids == hf_encode(ref_model_dir, prompt)
        assert output.finished and output.error is None
        assert_close(output, reference(ref_model_dir, output.prompt_token_ids, pooling_type), 2e-6 if device == "cpu" else 5e-5)
    for output in singles:
        assert_close(output, reference(ref_model_dir, output.prompt_token_ids, pooling_type), 2e-6 if device == "cpu" else 5e-5)
    assert (stats["prefix_cache_hits"] > 0) == (pooling_type == "LAST")
    assert stats["num_generation_tokens"] == 0
    assert stats["num_prompt_tokens"] == sum(len(o.prompt_token_ids) for o in outputs) - stats["prefix_cache_hits"]


def test_token_embeddings_equal_transformers_hidden_states(ref_artifact_128, ref_model_dir):
    """vLLM's pooling_task token_embed: every prompt token's final hidden state, normalized (or not), under
    16-token chunks; the long prompt's cached prefix is computed again (every row is needed)."""
    with LLM(ref_artifact_128, device="cpu", runner="pooling", max_num_batched_tokens=16) as llm:
        llm.embed(PROMPTS[2])  # its blocks in the prefix cache
        [normed, raw] = llm.encode([PROMPTS[2], PROMPTS[0]], [PoolingParams(), PoolingParams(normalize=False)],
                                   pooling_task="token_embed")
        with pytest.raises(RequestError, match=r"encode\(pooling_task='token_classify'\) is only supported for a sequence"):
            llm.encode("hi", pooling_task="token_classify")
        with pytest.raises(RequestError, match="runs task 'embed' or 'token_embed'"):
            llm.embed("hi", PoolingParams(task="token_classify"))
    for output, normalize in [(normed, True), (raw, False)]:
        ids = torch.tensor([output.prompt_token_ids])
        with torch.inference_mode():
            hidden = hf_model(ref_model_dir).model(input_ids=ids).last_hidden_state[0].double()
        expected = torch.nn.functional.normalize(hidden, dim=-1) if normalize else hidden
        assert output.outputs.data.shape == expected.shape
        assert (output.outputs.data.double() - expected).abs().max() < (2e-6 if normalize else 1e-4)


def test_normalize_off_and_per_request(ref_artifact_128, ref_model_dir):
    with LLM(ref_artifact_128, device="cpu", runner="pooling", pooler_config={"normalize": False}) as llm:
        raw, normed = llm.embed(PROMPTS[:2], [PoolingParams(), PoolingParams(normalize=True)])
        [cut] = llm.embed(PROMPTS[2], truncate_prompt_tokens=7)
        encoded = llm.encode(PROMPTS[:2])  # vLLM's generic form: the same vectors as float32 tensors
        with pytest.raises(RequestError, match=r"LLM.classify\(\) is only supported for a sequence classifier"):
            llm.encode(PROMPTS[0], pooling_task="classify")
        with pytest.raises(RequestError, match="pooling_task 'reward'"):
            llm.encode(PROMPTS[0], pooling_task="reward")
    assert [o.outputs.data.dtype for o in encoded] == [torch.float32] * 2
    assert torch.equal(encoded[0].outputs.data, torch.tensor(raw.outputs.embedding))
    assert_close(raw, reference(ref_model_dir, raw.prompt_token_ids, "LAST", normalize=False), 1e-4)
    assert_close(normed, reference(ref_model_dir, normed.prompt_token_ids, "LAST"), 2e-6)
    ids = hf_encode(ref_model_dir, PROMPTS[2])  # a text cut as the tokenizer truncates it: its BOS kept (vLLM's)
    assert cut.prompt_token_ids == ids[:1] + ids[-6:]
    assert_close(cut, reference(ref_model_dir, cut.prompt_token_ids, "LAST", normalize=False), 1e-4)


@pytest.mark.slow  # 5 s on 2 cores
def test_sentence_transformers_pooling_is_read_from_the_checkpoint(tmp_path, ref_model_dir):
    """A checkpoint with sentence-transformers files (mean pooling, no Normalize module) pools by them, as
    vLLM does; pooler_config overrides them; `llmc export` gives the files back."""
    checkpoint = tmp_path / "st"
    shutil.copytree(ref_model_dir, checkpoint)
    (checkpoint / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (checkpoint / "1_Pooling").mkdir()
    (checkpoint / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 384, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
         "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False}))
    artifact = tmp_path / "artifact"
    build(recipe_from_dict({"model": str(checkpoint), "output": str(artifact), "dtype": "float32",
                            "runtime": {"max_model_len": 128}}), show_progress=False)
    with LLM(artifact, device="cpu", runner="pooling") as llm:
        [mean] = llm.embed(PROMPTS[0])
    assert_close(mean, reference(ref_model_dir, mean.prompt_token_ids, "MEAN", normalize=False), 1e-4)
    with LLM(artifact, device="cpu", convert="embed", pooler_config={"pooling_type": "LAST", "normalize": True}) as llm:
        [last] = llm.embed(PROMPTS[0])
    assert_close(last, reference(ref_model_dir, last.prompt_token_ids, "LAST"), 2e-6)

    from llmc.compiler.export import export_artifact
    exported = tmp_path / "exported"
    export_artifact(artifact, exported)
    assert json.loads((exported / "1_Pooling" / "config.json").read_text())["pooling_mode_mean_tokens"] is True
    assert json.loads((exported / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_llm_score_is_the_cosine_of_the_embeddings(ref_artifact_128, ref_model_dir):
    """vLLM's LLM.score on an embedding model: one data_1 against each data_2, or pairs."""
    def cosine(a, b):
        x, y = (reference(ref_model_dir, hf_encode(ref_model_dir, t), "LAST", normalize=False) for t in (a, b))
        return float(torch.dot(x, y) / (x.norm() * y.norm()))

    with LLM(ref_artifact_128, device="cpu", runner="pooling", pooler_config={"normalize": False}) as llm:
        against_each = llm.score(PROMPTS[0], PROMPTS[1:])
        pairwise = llm.score(PROMPTS[:2], PROMPTS[2:])
        with pytest.raises(RequestError, match="data_1 has 2 texts and data_2 3"):
            llm.score(PROMPTS[:2], PROMPTS[1:])
    for output, text in zip(against_each, PROMPTS[1:]):
        assert abs(output.outputs.score - cosine(PROMPTS[0], text)) < 1e-5
    assert against_each[0].prompt_token_ids == hf_encode(ref_model_dir, PROMPTS[0]) + hf_encode(ref_model_dir, PROMPTS[1])
    assert [round(o.outputs.score, 5) for o in pairwise] == [round(cosine(a, b), 5) for a, b in zip(PROMPTS[:2], PROMPTS[2:])]


def test_what_a_pooling_engine_refuses(ref_artifact_128):
    with LLM(ref_artifact_128, device="cpu", runner="pooling") as llm:
        with pytest.raises(RequestError, match="embedding model.*does not generate"):
            llm.generate("hi", SamplingParams(max_tokens=2))
        with pytest.raises(RequestError, match="Matryoshka"):
            llm.embed("hi", PoolingParams(dimensions=8))
        with pytest.raises(RequestError, match="129 tokens but max_model_len is 128"):
            llm.embed([[5] * 129])
        [full] = llm.embed([[5] * 128])  # a whole context: nothing is generated after it
        assert len(full.outputs.embedding) == 384
        assert llm.engine.scheduler.block_pool.num_free_blocks == llm.engine.scheduler.block_pool.num_blocks
        with pytest.raises(RequestError, match="this model runs task 'embed'"):
            llm.embed("hi", PoolingParams(task="classify"))
        with pytest.raises(RequestError, match="is an embedding model"):
            llm.classify("hi")
    with pytest.raises(RequestError, match="task 'score'"):
        PoolingParams(task="score")
    with LLM(ref_artifact_128, device="cpu") as llm:
        with pytest.raises(RequestError, match="only supported for an embedding model.*generates text"):
            llm.embed("hi")
    for options, message in [({"convert": "classify"}, "needs a sequence classifier checkpoint"),
                             ({"runner": "pooling", "pooler_config": {"use_activation": False}}, "applies to classifiers"),
                             ({"runner": "generate", "convert": "embed"}, "runner pooling"),
                             ({"pooler_config": {"pooling_type": "MEAN"}}, "give runner pooling"),
                             ({"runner": "pooling", "pooler_config": {"pooling_type": "MAX"}}, "LAST, MEAN, CLS"),
                             ({"runner": "pooling", "pooler_config": {"softmax": True}}, "softmax"),
                             ({"runner": "pooling", "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
                              "does not apply to runner pooling")]:
        with pytest.raises(ConfigError, match=message):
            LLM(ref_artifact_128, device="cpu", **options)


def test_embeddings_through_run_time_lora_adapters(tmp_path, tiny_llama):
    """enable_lora: each prompt's embedding is PEFT's model's (the adapter's, or the base model's), in one call."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from llmc.runtime.lora import LoRARequest
    from tests.runtime.hf_oracle import build_float32, make_peft_adapter

    artifact = build_float32(tiny_llama, tmp_path / "base")
    adapter = make_peft_adapter(tiny_llama, tmp_path / "adapter", 1, r=4, lora_alpha=8, target_modules="all-linear")
    prompts = [[1, 5, 9, 200, 31, 7], [1, 5, 9, 200, 31, 7]]
    with LLM(artifact, device="cpu", runner="pooling", enable_lora=True, max_lora_rank=4) as llm:
        with_adapter, base = llm.embed(prompts, lora_request=[LoRARequest("a", 1, str(adapter)), None])
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
    with torch.inference_mode():
        expected_base = model.model(torch.tensor([prompts[1]])).last_hidden_state[0, -1].double()
        tuned = peft.PeftModel.from_pretrained(model, str(adapter))
        expected = tuned.base_model.model.model(torch.tensor([prompts[0]])).last_hidden_state[0, -1].double()
    assert_close(with_adapter, torch.nn.functional.normalize(expected, dim=0), 1e-5)
    assert_close(base, torch.nn.functional.normalize(expected_base, dim=0), 1e-5)
    assert (torch.tensor(with_adapter.outputs.embedding) - torch.tensor(base.outputs.embedding)).abs().max() > 1e-2


def test_a_pooling_recipe_is_checked_at_build_and_shown_by_inspect(tmp_path, ref_model_dir):
    import subprocess
    import sys

    from llmc.errors import RecipeError

    recipe = {"model": str(ref_model_dir), "output": str(tmp_path / "emb"),
              "runtime": {"runner": "pooling", "pooler_config": {"pooling_type": "MEAN"}, "max_model_len": 64}}
    with pytest.raises(RecipeError, match="runtime.speculative: .*does not apply to runner pooling"):
        build(recipe_from_dict({**recipe, "runtime": {**recipe["runtime"], "speculative": {"num_speculative_tokens": 2}}}),
              show_progress=False)
    with pytest.raises(RecipeError, match="runtime.convert 'reward'"):
        build(recipe_from_dict({**recipe, "runtime": {"convert": "reward"}}), show_progress=False)
    build(recipe_from_dict(recipe), show_progress=False)
    shown = subprocess.run([sys.executable, "-m", "llmc.cli", "inspect", str(tmp_path / "emb")], capture_output=True,
                           text=True, check=True).stdout
    assert "runner pooling (embeddings; pooling_type MEAN)" in shown


@pytest.mark.slow  # for the default run's time (session 42)
def test_llmc_run_prompt_prints_the_embedding(ref_artifact_128, ref_model_dir):
    """`llmc run --runner pooling --prompt TEXT`: the embedding as one JSON array on stdout; a sampling flag is refused
    before the model loads."""
    import json
    import subprocess
    import sys

    run = [sys.executable, "-m", "llmc.cli", "run", str(ref_artifact_128), "--device", "cpu", "--runner", "pooling",
           "--prompt", PROMPTS[0]]
    done = subprocess.run(run, capture_output=True, text=True, check=True)
    got = torch.tensor(json.loads(done.stdout), dtype=torch.float64)
    assert (got - reference(ref_model_dir, hf_encode(ref_model_dir, PROMPTS[0]), "LAST")).abs().max() < 2e-6
    refused = subprocess.run(run + ["--max-tokens", "4"], capture_output=True, text=True)
    assert refused.returncode == 2 and "--max-tokens samples generated text" in refused.stderr
    assert "KV cache" not in refused.stderr  # refused before the engine started
