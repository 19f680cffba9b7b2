"""POST /v1/embeddings on `llmc run --runner pooling`, through the openai SDK (which asks for base64 by
default) and raw HTTP, against transformers' hidden states (an onnx-cpu artifact's too); the generate endpoints
refuse on it, and /v1/embeddings refuses on a generating server; batch files take /v1/embeddings lines."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from llmc.cli import main

from tests.conftest import hf_encode, hf_model
from tests.runtime.server.conftest import API_KEY, MODEL, ServerProcess

TEXTS = ["ROMEO: what light through yonder window breaks?", "Hi", "But soft, what light " * 9]


@torch.inference_mode()
def reference(path, token_ids: list[int]) -> torch.Tensor:
    """LAST pooling, normalized: vLLM's default for a causal LM served as an embedding model."""
    ids = torch.tensor([token_ids])
    hidden = hf_model(path).model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden.double(), dim=0)


@pytest.fixture(scope="module")
def pooling_server(start_server):
    server = start_server("--runner", "pooling", "--api-key", API_KEY, "--served-model-name", MODEL,
                          "--disable-log-stats", "--trust-request-chat-template")
    yield server
    assert server.terminate() == 0, server.log()


@pytest.fixture
def embed_client(pooling_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{pooling_server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/embeddings", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=60)


def test_openai_sdk_embeddings_equal_transformers(embed_client, pooling_server, ref_model_dir):
    reply = embed_client.embeddings.create(model=MODEL, input=TEXTS)  # the SDK asks base64 and decodes it
    ids = [hf_encode(ref_model_dir, t) for t in TEXTS]
    assert [d.index for d in reply.data] == [0, 1, 2]
    for item, token_ids in zip(reply.data, ids):
        got = torch.tensor(item.embedding, dtype=torch.float64)
        assert (got - reference(ref_model_dir, token_ids)).abs().max() < 2e-6
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(map(len, ids))
    assert reply.model == MODEL and reply.object == "list"
    floats = embed_client.embeddings.create(model=MODEL, input=ids, encoding_format="float")  # token-id inputs
    # the same float32 values both ways, up to the rounding of another step's shapes (the long text's first
    # blocks now come from the prefix cache, so its step computes fewer tokens)
    assert torch.allclose(torch.tensor([d.embedding for d in floats.data]), torch.tensor([d.embedding for d in reply.data]),
                          rtol=0, atol=1e-6)


def test_embeddings_request_forms_and_errors(pooling_server, ref_model_dir):
    one = post(pooling_server, {"input": TEXTS[0]}).json()
    raw = post(pooling_server, {"input": TEXTS[0], "normalize": False}).json()["data"][0]["embedding"]
    assert abs(torch.tensor(raw).norm().item() - 1) > 0.1
    assert torch.allclose(torch.nn.functional.normalize(torch.tensor(raw), dim=0), torch.tensor(one["data"][0]["embedding"]),
                          atol=1e-6)
    cut = post(pooling_server, {"input": [[5, 6, 7, 8, 9]], "truncate_prompt_tokens": 2}).json()
    assert cut["usage"]["prompt_tokens"] == 2
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    chat = post(pooling_server, {"messages": [{"role": "user", "content": "Hi"}], "chat_template": template}).json()
    rendered = hf_encode(ref_model_dir, "user: Hi\n")[1:]  # the template gives no BOS; add_special_tokens is off
    assert chat["usage"]["prompt_tokens"] == len(rendered)
    assert (torch.tensor(chat["data"][0]["embedding"], dtype=torch.float64) - reference(ref_model_dir, rendered)).abs().max() < 2e-6
    for body, status, param in [({"input": "hi", "dimensions": 8}, 400, "dimensions"),
                                ({"input": [[5] * 300]}, 400, "input"),
                                ({"input": []}, 400, "input"),
                                ({"input": "hi", "messages": [{"role": "user", "content": "x"}]}, 400, "input"),
                                ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
                                ({"input": "hi", "softmax": True}, 400, "softmax"),
                                ({"input": [99999]}, 400, "input"),
                                ({"input": "hi", "model": "other"}, 404, "model")]:
        response = post(pooling_server, body)
        assert response.status_code == status, (body, response.text)
        assert response.json()["error"]["param"] == param, (body, response.text)
    pooled = httpx.post(f"{pooling_server.base_url}/pooling", json={"input": TEXTS[0]},
                        headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60).json()  # vLLM's /pooling
    assert pooled["id"].startswith("pool-") and pooled["data"][0]["object"] == "pooling"
    assert torch.allclose(torch.tensor(pooled["data"][0]["data"]), torch.tensor(one["data"][0]["embedding"]), atol=1e-6)
    refused = httpx.post(f"{pooling_server.base_url}/pooling", json={"input": "hi", "task": "classify"},
                         headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "task"
    completion = httpx.post(f"{pooling_server.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                            headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert completion.status_code == 400 and "does not generate" in completion.json()["error"]["message"]
    metrics = httpx.get(f"{pooling_server.base_url}/metrics", timeout=10).text
    assert 'request_success_total{finished_reason="stop",model_name="ref-llama"}' in metrics


def test_score_and_rerank_are_cosines_of_transformers_embeddings(pooling_server, ref_model_dir):
    """vLLM's /score and /rerank on an embedding model: the cosine similarity of the two texts' embeddings."""
    def cosine(a: str, b: str) -> float:
        x, y = (reference(ref_model_dir, hf_encode(ref_model_dir, t)) for t in (a, b))
        return float(torch.dot(x, y))  # both unit vectors

    headers = {"Authorization": f"Bearer {API_KEY}"}
    one_to_many = httpx.post(f"{pooling_server.base_url}/score", headers=headers, timeout=60,
                             json={"text_1": TEXTS[0], "text_2": TEXTS}).json()
    assert [d["index"] for d in one_to_many["data"]] == [0, 1, 2]
    for item, text in zip(one_to_many["data"], TEXTS):
        assert abs(item["score"] - cosine(TEXTS[0], text)) < 1e-5
    pairwise = httpx.post(f"{pooling_server.base_url}/v1/score", headers=headers, timeout=60,
                          json={"text_1": TEXTS[:2], "text_2": TEXTS[1:]}).json()
    assert [round(d["score"], 5) for d in pairwise["data"]] == [round(cosine(a, b), 5) for a, b in zip(TEXTS[:2], TEXTS[1:])]
    assert pairwise["usage"]["prompt_tokens"] == sum(len(hf_encode(ref_model_dir, t)) for t in TEXTS[:2] + TEXTS[1:])
    reranked = httpx.post(f"{pooling_server.base_url}/v2/rerank", headers=headers, timeout=60,
                          json={"query": TEXTS[2], "documents": TEXTS, "top_n": 2}).json()
    expected = sorted(range(3), key=lambda i: -cosine(TEXTS[2], TEXTS[i]))[:2]
    assert [r["index"] for r in reranked["results"]] == expected
    assert [r["document"]["text"] for r in reranked["results"]] == [TEXTS[i] for i in expected]
    assert abs(reranked["results"][1]["relevance_score"] - cosine(TEXTS[2], TEXTS[expected[1]])) < 1e-5
    for path, body, param in [("/v1/score", {"text_1": TEXTS[:2], "text_2": TEXTS}, "text_1"),
                              ("/rerank", {"query": "x", "documents": []}, "documents"),
                              ("/rerank", {"query": "x", "documents": ["y"], "top_n": -1}, "top_n")]:
        response = httpx.post(f"{pooling_server.base_url}{path}", headers=headers, json=body, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


@pytest.mark.slow  # a server of its own: 3.5 s on 2 cores
def test_onnx_cpu_embeddings_equal_transformers(tmp_path, ref_model_dir):
    """/v1/embeddings served from an onnx-cpu artifact (onnxruntime's hidden_states output, pooled as the torch
    runtime's): transformers' LAST hidden states, normalized."""
    from llmc.compiler.build import build
    from llmc.compiler.recipe import recipe_from_dict

    artifact = tmp_path / "onnx"
    build(recipe_from_dict({"model": str(ref_model_dir), "output": str(artifact), "dtype": "float32",
                            "target": {"device": "onnx-cpu"}, "runtime": {"max_model_len": 128}}), show_progress=False)
    server = ServerProcess(artifact, tmp_path / "server.log", "--runner", "pooling", "--api-key", API_KEY,
                           "--served-model-name", MODEL, "--disable-log-stats")
    try:
        server.wait_ready()
        reply = post(server, {"input": TEXTS, "encoding_format": "float"})
        assert reply.status_code == 200, reply.text
        for item, text in zip(reply.json()["data"], TEXTS):
            got = torch.tensor(item["embedding"], dtype=torch.float64)
            assert (got - reference(ref_model_dir, hf_encode(ref_model_dir, text))).abs().max() < 2e-6
    finally:
        assert server.terminate() == 0, server.log()


def test_a_generating_server_refuses_embeddings(client):
    with pytest.raises(openai.BadRequestError, match="does not support Embeddings API"):
        client.embeddings.create(model=MODEL, input="hi")


@pytest.mark.slow  # an engine of its own: 4 s on 2 cores
def test_batch_file_embeddings(tmp_path, server_artifact, ref_model_dir, restore_logging):
    lines = [{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"input": TEXTS[1]}},
             {"custom_id": "b", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x", "dimensions": 2}}]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(server_artifact), "--device", "cpu", "--runner", "pooling", "--input", str(source),
              "--output", str(target)])
    assert exit_info.value.code in (0, None)
    a, b = [json.loads(line) for line in target.read_text().splitlines()]
    got = torch.tensor(a["response"]["body"]["data"][0]["embedding"], dtype=torch.float64)
    assert (got - reference(ref_model_dir, hf_encode(ref_model_dir, TEXTS[1]))).abs().max() < 2e-6
    assert b["response"]["status_code"] == 400 and "Matryoshka" in b["response"]["body"]["error"]["message"]
