"""/v1/completions with vLLM's `prompt_embeds` (base64 of torch.save bytes; enable_prompt_embeds), in process:
the tokens equal LLM.generate's on the same rows and transformers' on inputs_embeds, embeddings before text
prompts, usage counting rows; the refusals as 400s in vLLM's words."""

from __future__ import annotations

import base64
import io

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from llmc.runtime.engine import Engine
from llmc.runtime.prompt_embeds import NOT_ENABLED
from llmc.runtime.server.api_server import build_app
from tests.runtime.hf_oracle import build_float32
from tests.runtime.server.conftest import API_KEY, MODEL
from tests.runtime.test_prompt_embeds import _embeds, _hf_greedy


def _b64(tensor: torch.Tensor) -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def llama(tiny_llama, tmp_path_factory):
    return tiny_llama, build_float32(tiny_llama, tmp_path_factory.mktemp("pe_server") / "a")


def _serve(run_app, artifact, **options) -> str:
    app = build_app(lambda: Engine(artifact, device="cpu", disable_log_stats=True, **options), "m", log_stats=False)
    return run_app(app, wait_healthy=True)


def test_completions_take_prompt_embeds(run_app, llama, hf_model, hf_encode):
    checkpoint, artifact = llama
    hf = hf_model(checkpoint)
    rows = [_embeds(hf, 9, seed=5), _embeds(hf, 3, seed=6).to(torch.bfloat16)]
    base_url = _serve(run_app, artifact, enable_prompt_embeds=True)
    body = {"model": "m", "prompt_embeds": [_b64(r) for r in rows], "prompt": "ROMEO:", "max_tokens": 6,
            "temperature": 0}
    reply = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    for choice, r in zip(choices[:2], rows):  # the embeddings first, in order (vLLM's), then the text
        assert choice["text"] == tokenizer.decode(_hf_greedy(hf, r.float(), 6)[0])
    assert reply.json()["usage"]["prompt_tokens"] == 9 + 3 + len(hf_encode(checkpoint, "ROMEO:"))
    # vLLM's client example: the openai SDK, an empty prompt, the embeddings (here [1, n, hidden]) in extra_body
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=60)
    one = client.completions.create(model="m", prompt="", max_tokens=6, temperature=0,
                                    extra_body={"prompt_embeds": _b64(rows[0][None])})
    assert one.choices[0].text == choices[0]["text"] and one.usage.prompt_tokens == 9
    refused = [
        ({"prompt_embeds": "bm90IGEgdGVuc29y"}, "prompt_embeds: not a base64 torch.save of a tensor"),
        ({"prompt_embeds": [_b64(rows[0]), _b64(torch.zeros(2, 5))]}, "prompt_embeds.1: rows of 5 values"),
        ({"prompt_embeds": _b64(rows[0]), "echo": True}, "echo: a prompt given as embeddings has no text"),
        ({"prompt_embeds": _b64(rows[0]), "prompt_logprobs": 1}, "prompt_logprobs: a prompt given as embeddings"),
    ]
    for extra, message in refused:
        reply = httpx.post(f"{base_url}/v1/completions", json={"model": "m", "max_tokens": 2, **extra}, timeout=60)
        assert reply.status_code == 400 and reply.json()["error"]["message"].startswith(message), reply.text


def test_refused_unless_enabled(server):
    reply = httpx.post(f"{server.base_url}/v1/completions", timeout=60, headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"model": MODEL, "prompt_embeds": _b64(torch.zeros(2, 8)), "max_tokens": 2})
    assert reply.status_code == 400 and reply.json()["error"]["message"] == NOT_ENABLED
