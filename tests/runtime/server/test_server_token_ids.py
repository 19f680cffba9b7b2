"""vLLM's return_token_ids (token ids beside the text, the prompt's once) and cache_salt on /v1/completions and
/v1/chat/completions, checked against the HF tokenizer; /reset_prefix_cache under VLLM_SERVER_DEV_MODE=1."""

from __future__ import annotations

import json

import httpx
from transformers import AutoTokenizer

from llmc.runtime.engine import Engine
from llmc.runtime.server.api_server import build_app
from tests.runtime.server.conftest import API_KEY, MODEL

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun."


def post(base_url: str, path: str, body: dict, headers=HEADERS) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json=body, headers=headers, timeout=60)


def _events(reply: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in reply.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_completions_return_token_ids(server, server_artifact):
    tokenizer = AutoTokenizer.from_pretrained(server_artifact / "tokenizer")
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0.9, "seed": 3, "return_token_ids": True,
            "n": 2}
    reply = post(server.base_url, "/v1/completions", body)
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    assert len(choices) == 2
    for choice in choices:
        assert choice["prompt_token_ids"] == tokenizer(PROMPT).input_ids
        assert len(choice["token_ids"]) == 12 and tokenizer.decode(choice["token_ids"]) == choice["text"]
    chunks = [c["choices"][0] for c in _events(post(server.base_url, "/v1/completions", {**body, "stream": True}))
              if c["choices"][0]["index"] == 0]
    assert chunks[0]["prompt_token_ids"] == tokenizer(PROMPT).input_ids
    assert all(c["prompt_token_ids"] is None for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == choices[0]["token_ids"]
    plain = post(server.base_url, "/v1/completions", {**body, "return_token_ids": None}).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain


def test_chat_return_token_ids(server, server_artifact):
    tokenizer = AutoTokenizer.from_pretrained(server_artifact / "tokenizer")
    messages = [{"role": "user", "content": "Who is there?"}]
    want_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    body = {"model": MODEL, "messages": messages, "max_tokens": 10, "temperature": 0, "return_token_ids": True}
    reply = post(server.base_url, "/v1/chat/completions", body).json()
    assert reply["prompt_token_ids"] == want_prompt
    (choice,) = reply["choices"]
    assert tokenizer.decode(choice["token_ids"]) == choice["message"]["content"]
    events = _events(post(server.base_url, "/v1/chat/completions", {**body, "stream": True}))
    carrying = [e for e in events if e.get("prompt_token_ids") is not None]
    assert len(carrying) == 1 and carrying[0]["prompt_token_ids"] == want_prompt
    assert [t for e in events for c in e["choices"] for t in c.get("token_ids", [])] == choice["token_ids"]


def test_cache_salt(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}

    def cached(**salt) -> int:
        reply = post(server.base_url, "/v1/completions", {**body, **salt})
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached(cache_salt="s1")
    assert cached(cache_salt="s1") > 0
    assert cached(cache_salt="a fresh salt") == 0
    reply = post(server.base_url, "/v1/chat/completions", {"model": MODEL, "max_tokens": 2, "cache_salt": "",
                                                         "messages": [{"role": "user", "content": "Hi"}]})
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == "Parameter 'cache_salt' must be a non-empty string if provided."


def test_reset_prefix_cache_endpoint(run_app, ref_artifact_128, monkeypatch):
    factory = lambda: Engine(ref_artifact_128, device="cpu", disable_log_stats=True)  # noqa: E731
    # vLLM's development endpoint: not routed (a 404) without VLLM_SERVER_DEV_MODE=1 (the app not served: no engine)
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    from fastapi.testclient import TestClient  # (outside `with`: no lifespan, no engine loaded)

    assert TestClient(build_app(factory, "m", log_stats=False)).post("/reset_prefix_cache").status_code == 404
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    dev = run_app(build_app(factory, "m", log_stats=False), wait_healthy=True)
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    post(dev, "/v1/completions", body, headers={})
    assert post(dev, "/v1/completions", body, headers={}).json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert httpx.post(f"{dev}/reset_prefix_cache", timeout=60).status_code == 200
    assert post(dev, "/v1/completions", body, headers={}).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
