"""Embeddings (runner pooling) on the onnx-cpu target: the graph's hidden_states output pooled as the torch
runtime pools, against transformers' last_hidden_state (float64 here), and an int4 build against the torch
runtime's embeddings of the same levels; a graph built without the output is refused by name."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import onnx
import pytest
import torch

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ConfigError
from llmc.runtime import artifact as art
from llmc.runtime import integrity
from llmc.runtime import onnx_model as om
from llmc.runtime.llm import LLM
from llmc.runtime.onnx_runner import OnnxRunner, _Chunk

from tests.conftest import hf_encode, hf_model
from tests.runtime.test_pooling import PROMPTS, assert_close, reference


def _build(model_dir, out, device="onnx-cpu", quantization=None):
    recipe = {"model": str(model_dir), "output": str(out), "dtype": "float32", "target": {"device": device},
              "runtime": {"max_model_len": 128, "runner": "pooling"}}
    if quantization:
        recipe["quantization"] = {"report": False, **quantization}
    build(recipe_from_dict(recipe), show_progress=False)
    return out


@pytest.fixture(scope="module")
def onnx_embedder(tmp_path_factory, ref_model_dir):
    """ref-llama-12m as an onnx-cpu embedding model (float32, max_model_len 128, runner pooling)."""
    return _build(ref_model_dir, tmp_path_factory.mktemp("onnx_pool") / "a")


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_onnx_embeddings_equal_transformers_hidden_states_pooled(onnx_embedder, ref_model_dir, pooling_type):
    # chunks of 16 tokens (the long prompts over several steps, beside others), two KV slots for six prompts:
    # each slot is taken again by a new prompt once its prompt completes; the fourth prompt shares the third's
    # first tokens, which the onnx-cpu runtime computes again (no prefix cache: KV lives in per-sequence slots)
    with LLM(onnx_embedder, device="cpu", pooler_config={"pooling_type": pooling_type}, max_num_batched_tokens=16,
             max_num_seqs=2) as llm:
        assert llm.engine.runner.num_slots == 2
        outputs = llm.embed(PROMPTS + [[1], [2]])
        stats = llm.stats()
        assert llm.engine.scheduler.block_pool.num_free_blocks == llm.engine.scheduler.block_pool.num_blocks
    for prompt, output in zip(PROMPTS, outputs):
        assert output.prompt_token_ids == hf_encode(ref_model_dir, prompt)
    for output in outputs:
        assert output.finished and output.error is None
        assert_close(output, reference(ref_model_dir, output.prompt_token_ids, pooling_type), 2e-6)
    assert stats["prefix_cache_hits"] == 0 and stats["num_generation_tokens"] == 0
    assert stats["num_prompt_tokens"] == sum(len(o.prompt_token_ids) for o in outputs)


def test_onnx_full_context_prompts_beside_shorter_chunks(onnx_embedder, ref_model_dir):
    """Chunks of 20 tokens: a 128-token prompt's last chunk (8 tokens at 120) runs beside another prompt's longer
    chunk, which padding to one call would push past the slot's 128 positions; it gets a call of its own."""
    prompts = [[(7 * i) % 3000 + 5 for i in range(128)], [(11 * i) % 3000 + 5 for i in range(60)],
               [(13 * i) % 3000 + 5 for i in range(128)]]
    with LLM(onnx_embedder, device="cpu", pooler_config={"pooling_type": "MEAN"}, max_num_batched_tokens=20,
             max_num_seqs=3) as llm:
        outputs = llm.embed([{"prompt_token_ids": p} for p in prompts])
    for output in outputs:
        assert_close(output, reference(ref_model_dir, output.prompt_token_ids, "MEAN"), 2e-6)


def test_pool_calls_batch_like_chunks_within_capacity_and_padding():
    """Which chunks of a pooling step share one onnxruntime call (OnnxRunner._pool_calls)."""
    def calls(*chunks, idle=()):  # chunks (slot, start, length); idle (slot, length): slots no chunk runs in
        lengths = [0] * 10
        for slot, length in [*idle, *((slot, start) for slot, start, _ in chunks)]:
            lengths[slot] = length
        runner = SimpleNamespace(capacity=128, lengths=lengths)
        return OnnxRunner._pool_calls(runner, [_Chunk(slot, start, [1] * n) for slot, start, n in chunks])

    assert calls((0, 0, 16), (1, 32, 16), (2, 0, 16), (3, 7, 16)) == [[0, 1, 2, 3]]  # like chunks: one call
    # 128 rows for 68 tokens, then 192 for 72: the third short chunk would make padding most of the call
    assert calls((0, 0, 4), (1, 0, 64), (2, 0, 4)) == [[1, 0], [2]]
    assert calls((0, 0, 12), (1, 120, 8)) == [[0], [1]]  # 120 + 12 passes the slot's 128 positions
    assert calls((0, 0, 16), (2, 0, 16), idle=[(1, 128)]) == [[0], [1]]  # and so would an idle full slot's padding
    assert calls((0, 0, 16), (2, 0, 16), idle=[(1, 100)]) == [[0, 1]]
    assert calls((0, 0, 16), (9, 0, 16)) == [[0], [1]]  # slots 1..8 idle: 160 rows computed for 32 tokens
    assert calls((0, 0, 16), (2, 0, 16), (1, 0, 8)) == [[0, 1, 2]]  # 48 rows for 40 tokens
    assert calls(*((slot, 0, 128) for slot in range(8))) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # MAX_POOL_CALL_ROWS 512


def _scheduled(row: int, token_ids: list[int], start: int, num_new: int) -> SimpleNamespace:
    """What pool_hidden reads of a scheduled chunk: its request's row, computed tokens and ids."""
    request = SimpleNamespace(request_id=str(row), batch_row=row, num_computed_tokens=start,
                              get_token_ids=lambda a, b: token_ids[a:b])
    return SimpleNamespace(request=request, num_new_tokens=num_new)


@torch.inference_mode()
def test_pool_hidden_is_every_token_in_batch_order_beside_a_full_slot(onnx_embedder, ref_model_dir):
    """OnnxRunner.pool_hidden's rows are transformers' last_hidden_state of the scheduled tokens, in batch order
    (not slot order), chunks continuing from earlier steps; slot 1, left full (128 of 128 positions) by a finished
    prompt, lies idle between the later steps' slots 0 and 2, so their chunks must not share a padded call."""
    full, a, b = ([(k * i) % 3000 + 5 for i in range(n)] for k, n in [(7, 128), (11, 40), (13, 24)])
    with LLM(onnx_embedder, device="cpu", max_num_seqs=3) as llm:
        runner = llm.engine.runner
        steps = [runner.pool_hidden(SimpleNamespace(requests=requests)).double() for requests in [
            [_scheduled(1, full, 0, 128)],
            [_scheduled(2, a, 0, 16), _scheduled(0, b, 0, 16)],
            [_scheduled(0, b, 16, 8), _scheduled(2, a, 16, 24)]]]
    hidden = {name: hf_model(ref_model_dir).model(input_ids=torch.tensor([ids])).last_hidden_state[0].double()
              for name, ids in [("full", full), ("a", a), ("b", b)]}
    expected = [hidden["full"], torch.cat([hidden["a"][:16], hidden["b"][:16]]),
                torch.cat([hidden["b"][16:], hidden["a"][16:]])]
    for got, want in zip(steps, expected):
        assert got.shape == want.shape
        # float32 states of magnitude up to ~7, summed in other orders: measured 7.2e-6
        assert (got - want).abs().max() < 1e-5 * want.abs().max(), (got - want).abs().max()


def test_onnx_int4_embeddings_match_the_torch_runtime(tmp_path, ref_model_dir):
    """RTN W4 g128, lm_head too (a MatMulNBits that a pooling call runs over no rows): the onnx-cpu build's
    embeddings are the torch runtime's of the same levels up to float32 summation order, and far from the
    unquantized model's (the quantized weights are what was computed)."""
    quantization = {"method": "rtn", "bits": 4, "group_size": 128, "ignore": []}
    onnx_dir = _build(ref_model_dir, tmp_path / "onnx", quantization=quantization)
    torch_dir = _build(ref_model_dir, tmp_path / "torch", device="cpu", quantization=quantization)
    assert art.read_manifest(onnx_dir).target["onnx"]["linears"]["lm_head"].startswith("MatMulNBits(bits=4")
    vectors = {}
    for name, path in [("onnx", onnx_dir), ("torch", torch_dir)]:
        with LLM(path, device="cpu", pooler_config={"pooling_type": "MEAN", "normalize": False},
                 max_num_batched_tokens=32) as llm:
            vectors[name] = torch.tensor([o.outputs.embedding for o in llm.embed(PROMPTS)], dtype=torch.float64)
    unquantized = torch.stack([reference(ref_model_dir, hf_encode(ref_model_dir, p), "MEAN", normalize=False)
                               for p in PROMPTS])
    # the same levels in float32, summed in another order by MLAS and torch: measured 4.2e-6 on values up to 3.2
    assert (vectors["onnx"] - vectors["torch"]).abs().max() < 2e-5
    assert (vectors["onnx"] - unquantized).abs().max() > 1e-2


def test_a_graph_without_hidden_states_is_refused_for_pooling(onnx_embedder, tmp_path):
    """An artifact built before onnx-cpu pooled (its graph's outputs: logits and the KV) still generates, and
    pooling on it is refused in one line that names the rebuild."""
    old = tmp_path / "old"
    shutil.copytree(onnx_embedder, old, ignore=shutil.ignore_patterns(integrity.STAMP_NAME))
    model = onnx.load(str(old / om.MODEL_PATH), load_external_data=False)
    [output] = [o for o in model.graph.output if o.name == om.HIDDEN_STATES]
    model.graph.output.remove(output)
    onnx.save_model(model, str(old / om.MODEL_PATH))
    manifest = json.loads((old / art.MANIFEST_NAME).read_text())
    manifest["files"][om.MODEL_PATH] = {"sha256": integrity.sha256_file(old / om.MODEL_PATH),
                                        "size": (old / om.MODEL_PATH).stat().st_size}
    manifest[integrity.DIGEST_KEY] = integrity.manifest_digest(manifest)
    (old / art.MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match="no hidden_states output .*; rebuild it"):
        LLM(old, device="cpu")
    with LLM(old, device="cpu", runner="generate") as llm:
        assert len(llm.generate([[1, 5, 9]])[0].outputs[0].token_ids) > 0


@torch.inference_mode()
def test_onnx_token_embed_is_every_prompt_token(onnx_embedder, ref_model_dir):
    """vLLM's token_embed on onnx-cpu: every prompt token's final hidden state (normalize off), chunked over steps."""
    prompts = [[(7 * i) % 3000 + 5 for i in range(50)], [(3 * i) % 3000 + 5 for i in range(9)]]
    with LLM(onnx_embedder, device="cpu", pooler_config={"normalize": False}, max_num_batched_tokens=16) as llm:
        outputs = llm.encode([{"prompt_token_ids": p} for p in prompts], pooling_task="token_embed")
    for output, ids in zip(outputs, prompts):
        want = hf_model(ref_model_dir).model(input_ids=torch.tensor([ids])).last_hidden_state[0].double()
        got = output.outputs.data.double()
        assert got.shape == want.shape
        assert (got - want).abs().max() < 1e-5 * want.abs().max(), (got - want).abs().max()  # measured 7.2e-6


def test_classifiers_and_cross_encoders_on_onnx(tmp_path, ref_model_dir, tiny_qwen2):
    """A sequence classifier's onnx-cpu graph gives its class logits (`score` as the head) and pooling reads the
    same head: class probabilities, rewards at every token, and a cross-encoder's scores equal transformers'."""
    from transformers import AutoTokenizer

    from tests.runtime.hf_oracle import make_classifier
    from tests.runtime.test_classify import hf_classifier, hf_classifier_logits

    checkpoint = make_classifier(ref_model_dir, tmp_path / "hf", 3)
    artifact = _build(checkpoint, tmp_path / "onnx")
    with LLM(artifact, max_num_batched_tokens=16) as llm:
        outputs = llm.classify(PROMPTS)
        [rewards] = llm.reward(PROMPTS[0])
    for output in outputs:
        expected = hf_classifier_logits(checkpoint, output.prompt_token_ids).softmax(-1)
        assert (torch.tensor(output.outputs.probs, dtype=torch.float64) - expected).abs().max() < 1e-5
    with torch.inference_mode():
        model = hf_classifier(checkpoint)
        hidden = model.model(torch.tensor([rewards.prompt_token_ids])).last_hidden_state[0].double()
    expected = (hidden @ model.score.weight.detach().double().T).softmax(-1)
    assert (rewards.outputs.data.double() - expected).abs().max() < 1e-5
    encoder = make_classifier(tiny_qwen2, tmp_path / "ce", 1, seed=1)
    tokenizer = AutoTokenizer.from_pretrained(str(encoder))
    with LLM(_build(encoder, tmp_path / "ce-onnx")) as llm:
        scores = llm.score("what light breaks", ["yonder window", "Hi"])
    for output, document in zip(scores, ["yonder window", "Hi"]):
        logit = hf_classifier_logits(encoder, tokenizer("what light breaks", text_pair=document)["input_ids"])
        assert abs(output.outputs.score - logit.sigmoid()[0].item()) < 1e-5
