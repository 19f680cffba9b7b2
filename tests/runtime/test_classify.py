"""Sequence classifiers (transformers' *ForSequenceClassification, vLLM's convert classify; runtime/pooling.py):
LLM.classify, LLM.encode and, on a cross-encoder of one label, LLM.score, against transformers' own classifier
run on the same checkpoint, in float64 here."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from llmc.compiler.build import build
from llmc.compiler.hf_checkpoint import _classifier_fields
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import CheckpointError, ConfigError, RecipeError, RequestError
from llmc.runtime.llm import LLM
from llmc.runtime.pooling import ClassificationRequestOutput, PoolingParams
from llmc.runtime.sampling_params import SamplingParams

from tests.runtime.hf_oracle import build_float32, make_classifier

LONG = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer " * 3
PROMPTS = ["ROMEO: what light through yonder window breaks?", "Hi", LONG, LONG[:120] + " the slings and arrows"]


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, ref_model_dir):
    """(checkpoint, float32 artifact) of ref-llama-12m with a 3-label head."""
    root = tmp_path_factory.mktemp("classifier")
    checkpoint = make_classifier(ref_model_dir, root / "hf", 3)
    return checkpoint, build_float32(checkpoint, root / "artifact")


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory, tiny_qwen2):
    """(checkpoint, float32 artifact) of a tiny Qwen2 with one label: a cross-encoder."""
    root = tmp_path_factory.mktemp("cross_encoder")
    checkpoint = make_classifier(tiny_qwen2, root / "hf", 1, seed=1)
    return checkpoint, build_float32(checkpoint, root / "artifact")


@functools.cache
def hf_classifier(checkpoint):
    from transformers import AutoModelForSequenceClassification

    return AutoModelForSequenceClassification.from_pretrained(str(checkpoint), dtype=torch.float32)


@torch.inference_mode()
def hf_classifier_logits(checkpoint, token_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor([token_ids])
    return hf_classifier(checkpoint)(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].double()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_class_probabilities_equal_transformers(classifier, device):
    checkpoint, artifact = classifier
    tolerance = 2e-6 if device == "cpu" else 5e-5
    # chunks of 16 tokens; the fourth prompt's first blocks are the third's, read from the prefix cache (on a GPU
    # through the piecewise graphs, and a step of one-token prompts through the decode graphs)
    with LLM(artifact, device=device, max_num_batched_tokens=16, gpu_memory_utilization=0.3) as llm:
        outputs = llm.classify(PROMPTS)
        raw = llm.classify(PROMPTS[:2], PoolingParams(use_activation=False))
        singles = llm.classify([[1], [2], [3]])
        encoded = llm.encode(PROMPTS[:2])  # vLLM's generic form: the model's task, float32 tensors
        stats = llm.stats()
        assert llm.engine.scheduler.block_pool.num_free_blocks == llm.engine.scheduler.block_pool.num_blocks
    assert stats["prefix_cache_hits"] > 0 and stats["num_generation_tokens"] == 0
    for output in outputs + singles:
        assert isinstance(output, ClassificationRequestOutput) and output.outputs.num_classes == 3
        expected = hf_classifier_logits(checkpoint, output.prompt_token_ids).softmax(-1)
        assert (torch.tensor(output.outputs.probs, dtype=torch.float64) - expected).abs().max() < tolerance
    assert {max(range(3), key=o.outputs.probs.__getitem__) for o in outputs} != {0}  # the head tells them apart
    for output in raw:  # use_activation false: transformers' logits themselves
        expected = hf_classifier_logits(checkpoint, output.prompt_token_ids)
        assert (torch.tensor(output.outputs.probs, dtype=torch.float64) - expected).abs().max() < 100 * tolerance
    # the same values (up to the rounding of a step whose prompts came from the prefix cache)
    assert torch.allclose(torch.stack([e.outputs.data for e in encoded]), torch.tensor([o.outputs.probs for o in outputs[:2]]),
                          atol=tolerance, rtol=0)


def test_rewards_at_every_token_equal_transformers(classifier):
    """vLLM's LLM.reward (pooling_task token_classify): the classifier at every prompt token, here under 16-token
    chunks, beside a sequence-level request in the same steps."""
    checkpoint, artifact = classifier
    base, score = hf_classifier(checkpoint).model, hf_classifier(checkpoint).score.weight.detach().double()
    with LLM(artifact, device="cpu", max_num_batched_tokens=16) as llm:
        rewards = llm.reward(PROMPTS[2:])
        raw = llm.encode(PROMPTS[0], PoolingParams(use_activation=False), pooling_task="token_classify")
        assert llm.engine.scheduler.block_pool.num_free_blocks == llm.engine.scheduler.block_pool.num_blocks
    for output in rewards + raw:
        with torch.inference_mode():
            hidden = base(torch.tensor([output.prompt_token_ids])).last_hidden_state[0].double()
        logits = hidden @ score.T  # [num_tokens, 3]
        expected = logits if output is raw[0] else logits.softmax(-1)
        assert output.outputs.data.shape == (len(output.prompt_token_ids), 3)
        assert (output.outputs.data.double() - expected).abs().max() < (2e-4 if output is raw[0] else 1e-5)


def test_mean_pooling_and_embeddings_of_a_classifier(classifier):
    """pooler_config MEAN: the head on the mean of the final hidden states; convert embed: the backbone's
    embedding, no head (the two vLLM allow on a classifier)."""
    checkpoint, artifact = classifier
    base, score = hf_classifier(checkpoint).model, hf_classifier(checkpoint).score.weight.detach().double()
    with LLM(artifact, device="cpu", pooler_config={"pooling_type": "MEAN"}, max_num_batched_tokens=16) as llm:
        [mean] = llm.classify(PROMPTS[2])
    with LLM(artifact, device="cpu", convert="embed") as llm:
        [embedding] = llm.embed(PROMPTS[0])
    with torch.inference_mode():
        hidden = base(torch.tensor([mean.prompt_token_ids])).last_hidden_state[0].double()
        last = base(torch.tensor([embedding.prompt_token_ids])).last_hidden_state[0, -1].double()
    expected = (hidden.mean(0) @ score.T).softmax(-1)
    assert (torch.tensor(mean.outputs.probs, dtype=torch.float64) - expected).abs().max() < 2e-6
    expected = torch.nn.functional.normalize(last, dim=0)
    assert (torch.tensor(embedding.outputs.embedding, dtype=torch.float64) - expected).abs().max() < 2e-6


def test_what_a_classifier_refuses(classifier, ref_artifact_128):
    _, artifact = classifier
    with LLM(artifact, device="cpu") as llm:
        with pytest.raises(RequestError, match="sequence classifier: it does not generate"):
            llm.generate("hi", SamplingParams(max_tokens=2))
        with pytest.raises(RequestError, match="LLM.embed.*is a sequence classifier"):
            llm.embed("hi")
        for params, message in [(PoolingParams(normalize=True), "normalize applies to embeddings"),
                                (PoolingParams(dimensions=8), "dimensions applies to embeddings"),
                                (PoolingParams(task="embed"), "runs task 'classify'")]:
            with pytest.raises(RequestError, match=message):
                llm.classify("hi", params)
        with pytest.raises(RequestError, match="cross-encoder.*3 labels"):
            llm.score("a", "b")
    for options, message in [({"runner": "generate"}, "sequence classifier.*runner 'generate' cannot run it"),
                             ({"pooler_config": {"normalize": True}}, "normalize applies to embeddings"),
                             ({"convert": "reward"}, "reward models"),
                             ({"hf_overrides": {"num_labels": 2}}, "set hf_overrides in the recipe"),
                             ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
                              "does not apply to runner pooling")]:
        with pytest.raises(ConfigError, match=message):
            LLM(artifact, device="cpu", **options)
    with pytest.raises(ConfigError, match="convert 'classify' needs a sequence classifier checkpoint"):
        LLM(ref_artifact_128, device="cpu", convert="classify")


def test_cross_encoder_scores_equal_transformers(cross_encoder):
    """One label: LLM.score encodes each (query, document) as one pair, as the tokenizer encodes pairs, and
    reports the sigmoid of the classifier's logit."""
    from transformers import AutoTokenizer

    checkpoint, artifact = cross_encoder
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    query, documents = "what light breaks", ["yonder window", "the east, and Juliet is the sun", "Hi"]
    with LLM(artifact, device="cpu") as llm:
        one_to_many = llm.score(query, documents)
        pairwise = llm.score(documents[:2], [query, query])
        with pytest.raises(RequestError, match="truncate_prompt_tokens"):
            llm.score(query, documents, truncate_prompt_tokens=4)
        with pytest.raises(RequestError, match="give text, not token ids"):
            llm.score({"prompt_token_ids": [1, 2]}, documents)
    for output, document in zip(one_to_many, documents):
        ids = tokenizer(query, text_pair=document)["input_ids"]
        assert output.prompt_token_ids == ids
        expected = hf_classifier_logits(checkpoint, ids).sigmoid()[0].item()
        assert abs(output.outputs.score - expected) < 2e-6
    for output, document in zip(pairwise, documents[:2]):
        expected = hf_classifier_logits(checkpoint, tokenizer(document, text_pair=query)["input_ids"]).sigmoid()[0]
        assert abs(output.outputs.score - expected.item()) < 2e-6
    assert len({round(o.outputs.score, 6) for o in one_to_many}) == 3


@pytest.mark.parametrize("config,activation", [
    ({}, "softmax"), ({"num_labels": 1}, "sigmoid"), ({"problem_type": "regression"}, "identity"),
    ({"problem_type": "multi_label_classification"}, "sigmoid"),
    ({"num_labels": 1, "problem_type": "single_label_classification"}, "sigmoid"),
    ({"num_labels": 1, "sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}}, "identity"),
    ({"num_labels": 1, "sbert_ce_default_activation_function": "torch.nn.modules.activation.Sigmoid"}, "sigmoid"),
])
def test_the_activation_follows_vllms_rule(config, activation):
    """transformers' loss for the problem_type, else sigmoid for one label and softmax for more; a
    sentence-transformers CrossEncoder's activation_fn first. No id2label: transformers' LABEL_i names."""
    fields = _classifier_fields(config)
    assert fields["classifier_activation"] == activation
    assert fields["labels"] == [f"LABEL_{i}" for i in range(config.get("num_labels", 2))]


def test_bad_classifier_configs_are_refused():
    for config, message in [({"id2label": {"0": "a", "2": "b"}}, "0..n-1"),
                            ({"id2label": {"0": "a"}, "num_labels": 2}, "disagrees"),
                            ({"problem_type": "ranking"}, "problem_type 'ranking'"),
                            ({"sentence_transformers": {"activation_fn": "torch.nn.Tanh"}}, "activation_fn")]:
        with pytest.raises(CheckpointError, match=message):
            _classifier_fields(config)


def test_a_quantized_classifier_builds_reports_and_exports(tmp_path, classifier, data_dir):
    """A w8 build keeps `score` dense and reports how its outputs follow the float model's; llmc export gives back
    a checkpoint transformers loads as the classifier (the float artifact: the same logits)."""
    from transformers import AutoModelForSequenceClassification

    from llmc.compiler.export import export_artifact

    checkpoint, artifact = classifier
    recipe = {"model": str(checkpoint), "output": str(tmp_path / "w8"), "runtime": {"max_model_len": 128},
              "target": {"device": "cpu"},
              "quantization": {"method": "rtn", "bits": 8, "group_size": 128,
                               "calibration": {"data": str(data_dir / "calibration.txt"), "num_samples": 4, "seq_len": 64}}}
    with pytest.raises(RecipeError, match="runtime.convert 'classify' makes a pooling model"):
        build(recipe_from_dict({**recipe, "runtime": {"runner": "generate", "convert": "classify"}}), show_progress=False)
    build(recipe_from_dict(recipe), show_progress=False)
    manifest = json.loads((tmp_path / "w8" / "manifest.json").read_text())
    report = manifest["quant"]["report"]
    assert 0 < report["classifier_mean_abs_difference"] < 0.01 and report["classifier_label_agreement"] >= 0.95
    assert "score" not in manifest["quant"]["modules"] and manifest["model"]["labels"] == ["class_0", "class_1", "class_2"]
    with LLM(tmp_path / "w8", device="cpu") as llm:
        [quantized] = llm.classify(PROMPTS[0])
    expected = hf_classifier_logits(checkpoint, quantized.prompt_token_ids).softmax(-1)
    assert (torch.tensor(quantized.outputs.probs, dtype=torch.float64) - expected).abs().max() < 0.02
    export_artifact(artifact, tmp_path / "exported")
    model = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "exported"), dtype=torch.float32)
    assert type(model).__name__ == "LlamaForSequenceClassification" and model.config.id2label[2] == "class_2"
    ids = quantized.prompt_token_ids
    with torch.inference_mode():
        got = model(input_ids=torch.tensor([ids])).logits[0].double()
    assert torch.equal(got, hf_classifier_logits(checkpoint, ids))


@pytest.mark.parametrize("method", ["from_2_way_softmax", "no_post_processing"])
def test_a_causal_reranker_converted_by_classifier_from_token(tmp_path, tiny_qwen3, method):
    """vLLM's hf_overrides for Qwen3-Reranker (architectures Qwen3ForSequenceClassification, classifier_from_token
    [no, yes]): the score is the causal LM's probability of the second token against the first at the last
    position, as the reranker's own recipe computes it; no_post_processing gives each token's logit as a label."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_qwen3))
    no, yes = tokenizer.convert_ids_to_tokens([200, 300])
    overrides = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": [no, yes],
                 **({"is_original_qwen3_reranker": True} if method == "from_2_way_softmax" else {"method": method})}
    artifact = build_float32(tiny_qwen3, tmp_path / "reranker", hf_overrides=overrides)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3), dtype=torch.float32)
    with LLM(artifact, device="cpu") as llm:
        if method == "from_2_way_softmax":
            outputs = llm.score("what light breaks", ["yonder window", "Hi"])
        else:
            outputs = llm.classify(["what light breaks", "Hi"], PoolingParams(use_activation=False))
    assert json.loads((artifact / "manifest.json").read_text())["model"]["labels"] == (
        ["LABEL_0"] if method == "from_2_way_softmax" else [no, yes])
    for output in outputs:
        with torch.inference_mode():
            logits = model(torch.tensor([output.prompt_token_ids])).logits[0, -1, [200, 300]].double()
        if method == "from_2_way_softmax":
            assert abs(output.outputs.score - logits.softmax(-1)[1].item()) < 2e-6
        else:
            assert (torch.tensor(output.outputs.probs, dtype=torch.float64) - logits).abs().max() < 2e-5


def test_classifier_from_token_is_checked(tmp_path, tiny_qwen3):
    recipe = {"model": str(tiny_qwen3), "output": str(tmp_path / "x")}
    for overrides, message in [
        ({"classifier_from_token": ["a", "b"]}, "set architectures to one too"),
        ({"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["zzzzqqq", "yes"]},
         "not in the tokenizer's vocabulary"),
        ({"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["a", "b", "c"],
          "method": "from_2_way_softmax"}, "takes two tokens"),
        ({"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["a"], "method": "mean"},
         "method 'mean'"),
    ]:
        with pytest.raises(CheckpointError, match=message):
            build(recipe_from_dict({**recipe, "hf_overrides": overrides}), show_progress=False)
