"""vLLM's /classify (and /v1/classify, /pooling) on a sequence classifier's artifact, and /score and /rerank on a
cross-encoder (a classifier of one label), over HTTP, against transformers' own classifier."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from llmc.cli import main

from tests.runtime.hf_oracle import build_float32, make_classifier
from tests.runtime.server.conftest import API_KEY, MODEL, ServerProcess
from tests.runtime.test_classify import hf_classifier, hf_classifier_logits

TEXTS = ["ROMEO: what light through yonder window breaks?", "Hi", "But soft, what light " * 9]
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def _serve(tmp_path_factory, source, num_labels: int, seed: int):
    root = tmp_path_factory.mktemp("classifier_server")
    checkpoint = make_classifier(source, root / "hf", num_labels, seed=seed)
    server = ServerProcess(build_float32(checkpoint, root / "artifact"), root / "server.log", "--api-key", API_KEY,
                           "--served-model-name", MODEL, "--disable-log-stats", "--trust-request-chat-template")
    server.wait_ready()
    return checkpoint, server


@pytest.fixture(scope="module")
def classify_server(tmp_path_factory, ref_model_dir):
    checkpoint, server = _serve(tmp_path_factory, ref_model_dir, 3, 0)
    yield checkpoint, server
    assert server.terminate() == 0, server.log()


@pytest.fixture(scope="module")
def cross_encoder_server(tmp_path_factory, tiny_qwen2):
    checkpoint, server = _serve(tmp_path_factory, tiny_qwen2, 1, 1)
    yield checkpoint, server
    assert server.terminate() == 0, server.log()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers=HEADERS, timeout=60)


def test_classify_equals_transformers(classify_server, ref_model_dir, hf_encode):
    checkpoint, server = classify_server
    reply = post(server, "/classify", {"model": MODEL, "input": TEXTS}).json()
    assert reply["id"].startswith("classify-") and reply["object"] == "list" and reply["model"] == MODEL
    ids = [hf_encode(ref_model_dir, t) for t in TEXTS]
    for item, token_ids, index in zip(reply["data"], ids, range(3)):
        expected = hf_classifier_logits(checkpoint, token_ids).softmax(-1)
        assert item["index"] == index and item["num_classes"] == 3
        assert (torch.tensor(item["probs"], dtype=torch.float64) - expected).abs().max() < 2e-6
        assert item["label"] == f"class_{int(expected.argmax())}"
    assert reply["usage"] == {"prompt_tokens": sum(map(len, ids)), "total_tokens": sum(map(len, ids)),
                              "completion_tokens": 0, "prompt_tokens_details": None}
    raw = post(server, "/v1/classify", {"input": [ids[1]], "use_activation": False}).json()  # token ids, logits
    assert (torch.tensor(raw["data"][0]["probs"], dtype=torch.float64)
            - hf_classifier_logits(checkpoint, ids[1])).abs().max() < 2e-4
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    chat = post(server, "/classify", {"messages": [{"role": "user", "content": "Hi"}], "chat_template": template}).json()
    rendered = hf_encode(ref_model_dir, "user: Hi\n")[1:]  # the template gives no BOS; add_special_tokens is off
    assert chat["usage"]["prompt_tokens"] == len(rendered)
    expected = hf_classifier_logits(checkpoint, rendered).softmax(-1)
    assert (torch.tensor(chat["data"][0]["probs"], dtype=torch.float64) - expected).abs().max() < 2e-6
    rewards = post(server, "/pooling", {"input": [ids[1]], "task": "token_classify"}).json()  # one row per token
    with torch.inference_mode():
        model = hf_classifier(checkpoint)
        hidden = model.model(torch.tensor([ids[1]])).last_hidden_state[0].double()
        expected = (hidden @ model.score.weight.detach().double().T).softmax(-1)
    assert (torch.tensor(rewards["data"][0]["data"], dtype=torch.float64) - expected).abs().max() < 1e-5
    pooled = post(server, "/pooling", {"input": TEXTS[0]}).json()  # vLLM's /pooling: the probabilities as data
    assert pooled["data"][0]["object"] == "pooling"  # (its prompt now from the prefix cache: a step of other shapes)
    assert torch.allclose(torch.tensor(pooled["data"][0]["data"]), torch.tensor(reply["data"][0]["probs"]), atol=1e-6)


def test_what_a_classifier_server_refuses(classify_server, server):
    _, classifier = classify_server
    for target, path, body, status, param, message in [
        (classifier, "/classify", {"input": [[5] * 300]}, 400, "input", "maximum context length"),
        (classifier, "/classify", {"input": []}, 400, "input", "empty"),
        (classifier, "/classify", {"input": "hi", "model": "other"}, 404, "model", "other"),
        (classifier, "/pooling", {"input": "hi", "task": "embed"}, 400, "task", "is a sequence classifier"),
        (classifier, "/pooling", {"input": "hi", "task": "token_embed"}, 400, "task", "is a sequence classifier"),
        (classifier, "/pooling", {"input": "hi", "normalize": True}, 400, "normalize", "applies to embeddings"),
        (classifier, "/v1/embeddings", {"input": "hi"}, 400, "model", "does not support Embeddings API"),
        (classifier, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, 400, None, "sequence classifier"),
        (classifier, "/score", {"text_1": "a", "text_2": "b"}, 400, "model", "cross-encoder"),
        (server, "/classify", {"input": "hi"}, 400, "model", "generates text"),
    ]:
        response = post(target, path, body)
        assert response.status_code == status, (path, body, response.text)
        error = response.json()["error"]
        assert message in error["message"], (path, body, response.text)
        if param is not None:
            assert error["param"] == param, (path, body, response.text)


@pytest.mark.slow  # a server of its own: 5 s on 2 cores (LLM.score's cross-encoder path is in test_classify)
def test_cross_encoder_score_and_rerank_equal_transformers(cross_encoder_server):
    from transformers import AutoTokenizer

    checkpoint, server = cross_encoder_server
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))

    def expected(a: str, b: str) -> float:
        return hf_classifier_logits(checkpoint, tokenizer(a, text_pair=b)["input_ids"]).sigmoid()[0].item()

    scores = post(server, "/score", {"text_1": TEXTS[0], "text_2": TEXTS}).json()
    assert [d["index"] for d in scores["data"]] == [0, 1, 2]
    for item, text in zip(scores["data"], TEXTS):
        assert abs(item["score"] - expected(TEXTS[0], text)) < 2e-6
    assert scores["usage"]["prompt_tokens"] == sum(len(tokenizer(TEXTS[0], text_pair=t)["input_ids"]) for t in TEXTS)
    reranked = post(server, "/v1/rerank", {"query": TEXTS[1], "documents": TEXTS, "top_n": 2}).json()
    order = sorted(range(3), key=lambda i: -expected(TEXTS[1], TEXTS[i]))[:2]
    assert [r["index"] for r in reranked["results"]] == order
    assert abs(reranked["results"][0]["relevance_score"] - expected(TEXTS[1], TEXTS[order[0]])) < 2e-6
    for path, body, param in [("/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 3},
                               "truncate_prompt_tokens"),
                              ("/rerank", {"query": "a", "documents": ["b"], "use_activation": False}, "use_activation")]:
        response = post(server, path, body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


@pytest.mark.slow  # an engine of its own: 6 s on 2 cores
def test_batch_file_classify(tmp_path, classify_server, ref_model_dir, hf_encode, restore_logging):
    checkpoint, server = classify_server
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/classify", "body": {"input": TEXTS[1]}},
             {"custom_id": "b", "method": "POST", "url": "/v1/classify", "body": {"input": [[5] * 300]}}]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(server.artifact), "--device", "cpu", "--input", str(source), "--output", str(target)])
    assert exit_info.value.code in (0, None)
    a, b = [json.loads(line) for line in target.read_text().splitlines()]
    expected = hf_classifier_logits(checkpoint, hf_encode(ref_model_dir, TEXTS[1])).softmax(-1)
    assert (torch.tensor(a["response"]["body"]["data"][0]["probs"], dtype=torch.float64) - expected).abs().max() < 2e-6
    assert b["response"]["status_code"] == 400 and "maximum context length" in b["response"]["body"]["error"]["message"]
