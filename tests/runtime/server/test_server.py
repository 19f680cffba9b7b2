"""The OpenAI-compatible server end to end: a real `llmc run` subprocess driven by the openai client."""

from __future__ import annotations

import asyncio
import httpx
from prometheus_client.parser import text_string_to_metric_families
import openai
import pytest
import torch

from llmc.runtime.llm import LLM

API_KEY = "sk-llmc-test"
MODEL = "ref-llama"
PROMPT = "Once upon a time, there was a little"


def test_models_health_version(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == 256
    assert client.models.retrieve(MODEL).id == MODEL  # OpenAI's GET /v1/models/{model}
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    assert client.completions.create(model="", prompt="x", max_tokens=1).model == MODEL  # "": the served model (vLLM)
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/ping").status_code == 200 == httpx.post(f"{server.base_url}/ping").status_code
    assert httpx.get(f"{server.base_url}/version").json()["version"]


def test_completion_and_its_stream_agree(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    choice = full.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert full.usage.completion_tokens == 12
    assert full.usage.prompt_tokens == full.usage.total_tokens - 12

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # The same usage, but for the prompt tokens the streamed request found in the prefix cache.
    streamed_usage, full_usage = chunks[-1].usage.model_dump(), full.usage.model_dump()
    assert streamed_usage.pop("prompt_tokens_details")["cached_tokens"] >= 0
    assert full_usage.pop("prompt_tokens_details")["cached_tokens"] >= 0
    assert chunks[-1].choices == [] and streamed_usage == full_usage


def test_n_2_streams_send_each_choice_s_finish_once(client):
    """A choice that finishes while its sibling runs on gets one finish chunk and nothing after it (its
    finish was repeated on every later step); the streamed texts are the unstreamed ones."""
    finished_apart = False
    for seed in range(3):
        common = dict(model=MODEL, max_tokens=30, temperature=1.0, seed=seed, n=2, stop=[","])
        full = client.completions.create(prompt="ROMEO:", **common)
        completion_chunks = [(c.index, c.text, c.finish_reason)
                             for chunk in client.completions.create(prompt="ROMEO:", stream=True, **common)
                             for c in chunk.choices]
        messages = [{"role": "user", "content": "ROMEO:"}]
        chat_chunks = [(c.index, c.delta.content or "", c.finish_reason)
                       for chunk in client.chat.completions.create(messages=messages, stream=True, **common)
                       for c in chunk.choices]
        for chunks in (completion_chunks, chat_chunks):
            for index in (0, 1):
                mine = [chunk for chunk in chunks if chunk[0] == index]
                assert [reason for _, _, reason in mine[:-1]] == [None] * (len(mine) - 1), mine
                assert mine[-1][2] in ("stop", "length"), mine
            for index in (0, 1):
                last = max(i for i, chunk in enumerate(chunks) if chunk[0] == index)
                finished_apart |= any(chunk[0] != index for chunk in chunks[last + 1 :])
        for index in (0, 1):
            assert "".join(t for i, t, _ in completion_chunks if i == index) == full.choices[index].text
    assert finished_apart  # some choice finished while the other ran on


def test_chat_stream_with_usage(client):
    messages = [{"role": "system", "content": "Tell stories."}, {"role": "user", "content": "A story about a cat"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0)
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [full.choices[0].finish_reason]


def test_chat_logprobs(client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                           temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
    assert "".join(e.token for e in content) == reply.choices[0].message.content


@pytest.fixture(scope="module")
def scorer(server_artifact):
    return LLM(server_artifact, device="cpu", num_kv_blocks=64)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_score_the_prompt_like_lm_eval(client, scorer, max_tokens):
    """lm-eval local-completions: token ids, echo, max_tokens 0 or 1, logprobs k."""
    token_ids = scorer.tokenizer.encode(PROMPT)
    reply = client.completions.create(model=MODEL, prompt=token_ids, echo=True, max_tokens=max_tokens, logprobs=2,
                                      temperature=0)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.token_logprobs) == len(token_ids) + max_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = torch.log_softmax(scorer.engine.score(token_ids), dim=-1)  # [len, vocab]
    for position in range(1, len(token_ids)):
        want = expected[position - 1, token_ids[position]].item()
        assert logprobs.token_logprobs[position] == pytest.approx(want, abs=1e-3)
        top = logprobs.top_logprobs[position]
        assert max(top.values()) == pytest.approx(expected[position - 1].max().item(), abs=1e-3)
        assert logprobs.tokens[position] in top and 2 <= len(top) <= 3
    prompt_text = scorer.tokenizer.decode(token_ids)  # echo of a token-id prompt: its decoded text
    assert reply.choices[0].text.startswith(prompt_text) and (max_tokens or reply.choices[0].text == prompt_text)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    assert reply.usage.completion_tokens == max_tokens


@pytest.mark.parametrize("as_text", [True, False])
def test_truncated_prompt_is_what_echo_logprobs_and_usage_show(client, scorer, as_text):
    """truncate_prompt_tokens keeps the last k prompt tokens (a text prompt its BOS and its last k - 1, as
    the tokenizer's truncation from the left gives them to vLLM); echo shows those tokens decoded, and
    each logprob entry is labelled with its own token (vLLM cuts the prompt before it is echoed)."""
    token_ids = scorer.tokenizer.encode(PROMPT)
    assert token_ids[0] == scorer.tokenizer.bos_token_id
    kept = token_ids[:1] + token_ids[-2:] if as_text else token_ids[-3:]
    reply = client.completions.create(model=MODEL, prompt=PROMPT if as_text else token_ids, echo=True, max_tokens=2,
                                      logprobs=0, temperature=0, extra_body={"truncate_prompt_tokens": 3})
    choice, logprobs = reply.choices[0], reply.choices[0].logprobs
    assert reply.usage.prompt_tokens == 3
    assert choice.text.startswith(scorer.tokenizer.decode(kept)) and not choice.text.startswith(PROMPT)
    assert logprobs.tokens[:3] == [scorer.tokenizer.decode([t]) for t in kept]
    assert logprobs.token_logprobs[0] is None and len(logprobs.tokens) == 5
    expected = torch.log_softmax(scorer.engine.score(kept), dim=-1)
    for position in (1, 2):
        assert logprobs.token_logprobs[position] == pytest.approx(expected[position - 1, kept[position]].item(), abs=1e-3)
        assert list(logprobs.top_logprobs[position]) == [logprobs.tokens[position]]


def test_token_id_and_list_prompts(client, scorer):
    ids = [scorer.tokenizer.encode(p) for p in ("The cat", "A dog ran")]
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt=["The cat", "A dog ran"], max_tokens=5, temperature=0)
    assert [c.index for c in by_ids.choices] == [0, 1]
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    assert by_ids.usage.prompt_tokens == sum(map(len, ids))


def test_n_sequences_per_prompt(client):
    reply = client.completions.create(model=MODEL, prompt=["The cat", "A dog"], n=3, max_tokens=6, temperature=1.0,
                                      seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in reply.choices) == list(range(6))
    assert reply.usage.completion_tokens == 6 * 6
    again = client.completions.create(model=MODEL, prompt=["The cat", "A dog"], n=3, max_tokens=6, temperature=1.0,
                                      seed=7, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in reply.choices]  # seeded


def test_stop_strings(client):
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = free.strip().split()[2]  # a word from the middle of the greedy continuation
    reply = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
    assert choice.text == free[: free.index(stop)]
    kept = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop,
                                     extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.text == free[: free.index(stop) + len(stop)]


def test_64_concurrent_streams_complete_with_correct_usage(async_client, scorer):
    prompts = [f"Story number {i}: once" for i in range(64)]

    async def one(prompt: str) -> tuple[int, int, dict]:
        stream = await async_client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, temperature=0.8, seed=len(prompt), stream=True, logprobs=0,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        num_tokens, usage = 0, None
        async for chunk in stream:
            if chunk.choices:
                num_tokens += len(chunk.choices[0].logprobs.tokens)
            if chunk.usage:
                usage = chunk.usage.model_dump()
        return len(scorer.tokenizer.encode(prompt)), num_tokens, usage

    async def all_of_them():
        return await asyncio.gather(*(one(p) for p in prompts))

    for num_prompt, num_streamed, usage in asyncio.run(all_of_them()):
        assert num_streamed == 6
        assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
            num_prompt, 6, num_prompt + 6)


def _wait_idle(server, read_metrics, timeout: float = 5.0) -> dict:
    import time

    deadline = time.monotonic() + timeout
    while True:
        metrics = read_metrics(server.base_url)
        if metrics["llmc:num_requests_running"] == 0 and metrics["llmc:kv_cache_usage_perc"] == 0:
            return metrics
        assert time.monotonic() < deadline, f"not idle after {timeout} s: {metrics}"
        time.sleep(0.05)


def _aborted_total(server) -> float:
    """llmc:request_success_total{finished_reason="abort"} (vLLM counts aborted requests there)."""
    text = httpx.get(f"{server.base_url}/metrics").text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "llmc:request_success_total" and s.labels.get("finished_reason") == "abort")


def test_disconnects_abort_requests_and_free_their_blocks(client, server, read_metrics):
    aborted_before, latencies_before = _aborted_total(server), read_metrics(server.base_url)[
        "llmc:e2e_request_latency_seconds_count"]
    streams = [client.completions.create(model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=200, temperature=0.8,
                                         stream=True, extra_body={"ignore_eos": True}) for i in range(4)]
    for stream in streams:
        next(iter(stream))  # generation has started
    busy = read_metrics(server.base_url)
    assert busy["llmc:num_requests_running"] >= 1 and busy["llmc:kv_cache_usage_perc"] > 0
    for stream in streams:
        stream.close()
    # A non-streaming request whose client gives up is aborted too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"prompt": PROMPT, "max_tokens": 240, "ignore_eos": True}, timeout=0.2)
    idle = _wait_idle(server, read_metrics)
    assert idle["llmc:num_requests_waiting"] == 0
    # the five aborted requests are counted, as finished with reason "abort", each with its latency
    assert _aborted_total(server) == aborted_before + 5
    assert idle["llmc:e2e_request_latency_seconds_count"] == latencies_before + 5


def test_metrics_names(client, server, read_metrics):
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
    metrics = read_metrics(server.base_url)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                 "prompt_tokens_total", "generation_tokens_total", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
                 "request_queue_time_seconds_count"):
        assert f"llmc:{name}" in metrics, name
    assert metrics["llmc:generation_tokens_total"] >= 3 and metrics["llmc:e2e_request_latency_seconds_count"] >= 1
    text = httpx.get(f"{server.base_url}/metrics").text
    assert f'llmc:num_requests_running{{model_name="{MODEL}"}}' in text


def test_tokenize_detokenize(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    tokens = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "hello world"}, headers=headers).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 256
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": tokens["tokens"][1:]}, headers=headers).json()
    assert text == {"prompt": "hello world"}
    chat = httpx.post(f"{server.base_url}/tokenize", headers=headers,
                      json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 3


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "logprobs": -1}, "logprobs"),  # the whole vocabulary: above the server's max_logprobs (20)
    ({"prompt": "x", "n": 11, "use_beam_search": True}, "n"),  # 2 x beam width logprobs a step, above 20
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": [1, 2, 10**6]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "logit_bias": {"-5": 5}}, "logit_bias"),  # a bias beyond ±100 is clamped (vLLM's), not refused
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "priority": 2}, "priority"),  # the session server schedules fcfs
    ({"prompt": "x", "temperature": 0, "best_of": 2}, "best_of"),
    ({}, "prompt"),
])
def test_invalid_completion_parameters_are_400_naming_the_field(server, body, param):
    reply = httpx.post(f"{server.base_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and param in error["message"]
    assert "SamplingParams" not in error["message"]  # the request's field, not the engine's class


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}, "response_format.type"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x" * 2000}]}, "messages"),
])
def test_invalid_chat_parameters_are_400(server, body, param):
    reply = httpx.post(f"{server.base_url}/v1/chat/completions", json=body,
                       headers={"Authorization": f"Bearer {API_KEY}"})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_error_statuses_and_the_server_keeps_serving(client, server):
    with pytest.raises(openai.BadRequestError) as info:  # prompt over max_model_len
        client.completions.create(model=MODEL, prompt=list(range(10, 400)), max_tokens=1)
    assert info.value.body["code"] == "context_length_exceeded" and "256" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert info.value.body["code"] == "model_not_found"
    wrong_key = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.models.list()
    assert httpx.get(f"{server.base_url}/v1/models").status_code == 401  # no key at all
    missing = httpx.get(f"{server.base_url}/nowhere")
    assert missing.status_code == 404 and missing.json()["error"]["code"] is None  # OpenAI's: a string or null
    bad_json = httpx.post(f"{server.base_url}/v1/completions", content=b"{not json",
                          headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert bad_json.status_code == 400 and "JSON" in bad_json.json()["error"]["message"]
    huge_int = httpx.post(f"{server.base_url}/v1/completions", content=b'{"prompt": "x", "seed": ' + b"1" * 4301 + b"}",
                          headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert huge_int.status_code == 400 and "JSON" in huge_int.json()["error"]["message"]  # json.loads: ValueError
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices[0].text
