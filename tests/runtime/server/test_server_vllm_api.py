"""vLLM's OpenAI-server behaviour, through the openai client against the session's `llmc run`
subprocess: prompt_logprobs (checked against transformers' own log-softmax), continuous usage
statistics, cached prompt tokens, context-length and seed validation, choice indices with
best_of, media types, error bodies, unsupported fields, and echo's logprob offsets."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

API_KEY = "sk-llmc-test"
MODEL = "ref-llama"
MAX_MODEL_LEN = 256
BLOCK_SIZE = 16
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = ["A robot may not injure another robot", "My name is"]
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Where was it played?"}]


@pytest.fixture(scope="module")
def tokenizer(server_artifact):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(server_artifact / "tokenizer")


def _post(server, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers=HEADERS, timeout=60, **kwargs)


def _check_prompt_logprobs(entries, token_ids, num_top, hf_logits, ref_model_dir, tokenizer):
    """vLLM's shape, each value against transformers' float32 log-softmax of the same ids."""
    assert len(entries) == len(token_ids) and entries[0] is None
    expected = torch.log_softmax(hf_logits(ref_model_dir, token_ids), dim=-1)  # [len, vocab]
    for position in range(1, len(token_ids)):
        row, token = expected[position - 1], token_ids[position]
        entry = {int(t): value for t, value in entries[position].items()}
        top = row.topk(num_top).indices.tolist()
        assert set(entry) == set(top) | {token}
        assert entry[token]["logprob"] == pytest.approx(row[token].item(), abs=1e-3)
        # vLLM's rank: the place in the whole vocabulary, the prompt token's too (inside the top k or not)
        assert entry[token]["rank"] == int((row > row[token]).sum()) + 1
        for rank, t in enumerate(top, start=1):
            assert entry[t]["rank"] == rank and entry[t]["decoded_token"] == tokenizer.decode([t])


def test_prompt_logprobs_on_completions(client, tokenizer, hf_logits, ref_model_dir):
    reply = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=2, temperature=0,
                                      extra_body={"prompt_logprobs": 2})
    assert len(reply.choices) == 2
    for choice, prompt in zip(reply.choices, PROMPTS):
        _check_prompt_logprobs(choice.model_extra["prompt_logprobs"], tokenizer.encode(prompt), 2, hf_logits,
                               ref_model_dir, tokenizer)
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=2)
    assert plain.choices[0].model_extra.get("prompt_logprobs") is None


def test_prompt_logprobs_on_chat(client, server, tokenizer, hf_logits, ref_model_dir):
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2,
                                           extra_body={"prompt_logprobs": 1})
    token_ids = _post(server, "/tokenize", {"messages": CHAT}).json()["tokens"]
    assert reply.usage.prompt_tokens == len(token_ids)
    # vLLM puts them on the response, next to `choices`.
    _check_prompt_logprobs(reply.model_extra["prompt_logprobs"], token_ids, 1, hf_logits, ref_model_dir, tokenizer)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("value", [-1, 21])
def test_prompt_logprobs_out_of_range_are_400(client, endpoint, value):
    create = client.completions.create if endpoint == "completions" else client.chat.completions.create
    kwargs = {"prompt": "x"} if endpoint == "completions" else {"messages": CHAT}
    with pytest.raises(openai.BadRequestError) as info:
        create(model=MODEL, max_tokens=2, extra_body={"prompt_logprobs": value}, **kwargs)
    assert info.value.body["param"] == "prompt_logprobs"


def test_continuous_usage_stats(client, tokenizer):
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, stream=True,
                                       stream_options={"include_usage": True, "continuous_usage_stats": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    counts = [c.usage.completion_tokens for c in chunks]
    assert {c.usage.prompt_tokens for c in chunks} == {len(tokenizer.encode(PROMPTS[0]))}
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 5
    for chunk in chunks[:-1]:  # each carries exactly the tokens streamed so far
        assert chunk.choices and chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
    assert chunks[-1].choices == []
    off = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, stream=True,
                                    stream_options={"include_usage": False, "continuous_usage_stats": True})
    assert all(chunk.usage is None for chunk in off)


def test_continuous_usage_stats_on_chat(client):
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=6, temperature=0,
                                            stream=True, extra_body={"min_tokens": 6},
                                            stream_options={"include_usage": True, "continuous_usage_stats": True})
    last = 0
    for chunk in stream:  # vLLM's own check: strictly growing, but for the final usage chunk
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        assert last == 0 or chunk.usage.completion_tokens > last or (
            not chunk.choices and chunk.usage.completion_tokens == last)
        last = chunk.usage.completion_tokens
    assert last == 6


def test_cached_tokens_count_prefix_cache_hits(client):
    prompt = " ".join(f"word{i}" for i in range(30))  # a prompt no other test sends: > 3 blocks of 16
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    num_prompt = first.usage.prompt_tokens
    assert num_prompt > 3 * BLOCK_SIZE
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached % BLOCK_SIZE == 0 and num_prompt - BLOCK_SIZE <= cached < num_prompt
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    assert chat.usage.prompt_tokens_details.cached_tokens >= 0


def test_prompt_plus_max_tokens_over_the_context_is_400(client):
    prompt = [10 + i % 50 for i in range(240)]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=17)
    assert info.value.body["code"] == "context_length_exceeded" and info.value.body["param"] == "max_tokens"
    assert str(MAX_MODEL_LEN) in info.value.body["message"]
    fits = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, extra_body={"ignore_eos": True})
    assert fits.usage.completion_tokens == 16
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=5000)
    assert info.value.body["code"] == "context_length_exceeded"
    assert info.value.body["param"] == "max_completion_tokens"


def test_max_tokens_omitted_fills_the_context(client, server):
    messages = [{"role": "user", "content": "word " * 220}]
    num_prompt = len(_post(server, "/tokenize", {"messages": messages}).json()["tokens"])
    assert num_prompt < MAX_MODEL_LEN - 8
    chat = client.chat.completions.create(model=MODEL, messages=messages, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == MAX_MODEL_LEN - num_prompt
    assert chat.choices[0].finish_reason == "length"
    prompt = [10 + i % 50 for i in range(244)]
    reply = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": None, "ignore_eos": True}).json()
    assert reply["usage"]["completion_tokens"] == MAX_MODEL_LEN - 244


def test_best_of_returns_indices_from_zero(client):
    for seed in range(4):
        reply = client.completions.create(model=MODEL, prompt=PROMPTS, n=1, best_of=4, max_tokens=4, seed=seed,
                                          temperature=1.0)
        assert [c.index for c in reply.choices] == [0, 1]
    reply = client.completions.create(model=MODEL, prompt=PROMPTS[0], n=2, best_of=4, max_tokens=4, seed=1)
    assert sorted(c.index for c in reply.choices) == [0, 1]


def test_seed_outside_int64_is_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, seed=2**63)
    assert info.value.body["param"] == "seed"
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=1, seed=2**63 - 1).choices
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=1, seed=-(2**63)).choices


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_body_that_is_not_sent_as_json_is_400(server, content_type):
    headers = {**HEADERS, **({"Content-Type": content_type} if content_type else {})}
    reply = httpx.post(f"{server.base_url}/v1/completions", headers=headers, timeout=60,
                       content=b'{"prompt": "x", "max_tokens": 1}')
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["type"] == "invalid_request_error"
    ok = httpx.post(f"{server.base_url}/v1/completions", content=b'{"prompt": "x", "max_tokens": 1}', timeout=60,
                    headers={**HEADERS, "Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


def test_out_of_vocabulary_token_ids(client):
    with pytest.raises(openai.BadRequestError, match="out of vocabulary") as info:
        client.completions.create(model=MODEL, prompt=[999999], max_tokens=5)
    assert info.value.body["param"] == "prompt"


@pytest.mark.parametrize("prompt", [None, ""])
def test_empty_prompt_in_vllm_words(server, prompt):
    reply = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 5})
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == "Either prompt or prompt_embeds must be provided and non-empty."


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "stream": False, "stream_options": {"continuous_usage_stats": True}},
     400, "stream_options"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 30, "logprobs": True}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "seed": "x"}, 400, "seed"),
])
def test_error_bodies_name_the_field_and_code_is_a_string_or_null(server, path, body, status, param):
    reply = _post(server, path, body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param
    assert error["code"] is None or isinstance(error["code"], str)


@pytest.mark.parametrize("field", [{"early_stopping": True}, {"guided_whitespace_pattern": "[ ]*"},
                                   {"guided_decoding_backend": "outlines"}])
def test_fields_that_would_change_the_output_are_refused(server, field):
    reply = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, **field})
    assert reply.status_code == 400, reply.text
    (name,) = field
    assert reply.json()["error"]["param"] == name and name in reply.json()["error"]["message"]


def test_harmless_fields_and_no_model_are_accepted(server):
    body = {"prompt": "x", "max_tokens": 2, "use_beam_search": False, "some_client_field": 1}
    reply = _post(server, "/v1/completions", body)  # no model: OpenAI allows it for a single-model server
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == MODEL


def _assert_offsets_match(text: str, logprobs: dict) -> None:
    assert "".join(logprobs["tokens"]) == text
    for offset, token in zip(logprobs["text_offset"], logprobs["tokens"]):
        assert text[offset:offset + len(token)] == token


def test_echo_logprobs_are_consistent_with_the_echoed_text(server, tokenizer):
    prompt = "Once upon a time, there was a café"
    body = {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0}
    reply = _post(server, "/v1/completions", body).json()
    choice = reply["choices"][0]
    assert choice["text"].startswith(prompt)
    assert len(choice["logprobs"]["tokens"]) == len(tokenizer.encode(prompt)) + 3
    assert choice["logprobs"]["token_logprobs"][0] is None
    _assert_offsets_match(choice["text"], choice["logprobs"])
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json={**body, "stream": True}, headers=HEADERS,
                      timeout=60) as stream:
        events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    text = "".join(e["choices"][0]["text"] for e in events)
    merged = {key: [v for e in events for v in e["choices"][0]["logprobs"][key]] for key in ("tokens", "text_offset")}
    assert text == choice["text"]
    _assert_offsets_match(text, merged)


@pytest.fixture(scope="module")
def beam_reference(server_artifact):
    """The prefix-cache beam search (one max_tokens=1 request per beam and round) in this process."""
    from llmc.runtime.beam_search import BeamSearchParams, beam_search_by_requests
    from llmc.runtime.llm import LLM
    from llmc.runtime.tokenizer import apply_chat_template

    with LLM(server_artifact, disable_log_stats=True) as llm:
        params = BeamSearchParams(beam_width=3, max_tokens=6, length_penalty=0.7)
        prompts = [llm.tokenizer.encode(p) for p in PROMPTS] + [apply_chat_template(llm.tokenizer, CHAT)]
        yield [beam_search_by_requests(llm, [p], params)[0] for p in prompts]


def test_use_beam_search_returns_the_n_best_beams(client, beam_reference):
    """use_beam_search with n=3 over HTTP (completions and chat): the choices are the 3 beams the
    prefix-cache implementation finds, best first."""
    extra = {"use_beam_search": True, "length_penalty": 0.7}
    reply = client.completions.create(model=MODEL, prompt=PROMPTS, n=3, max_tokens=6, extra_body=extra)
    assert len(reply.choices) == 6
    for i, reference in enumerate(beam_reference[:2]):
        choices = sorted((c for c in reply.choices if c.index // 3 == i), key=lambda c: c.index)
        assert [c.text for c in choices] == [s.text for s in reference.sequences]
        assert [c.finish_reason for c in choices] == [s.finish_reason for s in reference.sequences]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, n=3, max_tokens=6, extra_body=extra)
    assert [c.message.content for c in chat.choices] == [s.text for s in beam_reference[2].sequences]


def test_use_beam_search_refuses_streaming_and_fields_it_cannot_honour(server):
    for extra, name in (({"stream": True}, "stream"), ({"stop": ["x"]}, "stop"), ({"logprobs": 2}, "logprobs"),
                        ({"best_of": 4}, "best_of")):
        body = {"prompt": "x", "max_tokens": 2, "n": 2, "use_beam_search": True, **extra}
        reply = _post(server, "/v1/completions", body)
        assert reply.status_code == 400, reply.text
        assert name in reply.json()["error"]["message"]


THINKING_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}"
                     "<|assistant|>{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
                     "{% endif %}")


def test_chat_template_options(server, tokenizer):
    """vLLM's chat_template, chat_template_kwargs (Qwen3's enable_thinking), add_generation_prompt and
    continue_final_message, on /tokenize and chat completions: the prompt transformers renders from the
    same arguments; contradictory or reserved ones are a 400 naming the field."""
    answer_started = CHAT + [{"role": "assistant", "content": "In the"}]
    cases = [
        (CHAT, {"chat_template": THINKING_TEMPLATE, "chat_template_kwargs": {"enable_thinking": False}}),
        (CHAT, {"chat_template": THINKING_TEMPLATE}),
        (CHAT, {"add_generation_prompt": False}),
        (answer_started, {"add_generation_prompt": False, "continue_final_message": True}),
    ]
    prompts = []
    for messages, options in cases:
        reference = {"add_generation_prompt": True, **options, **options.get("chat_template_kwargs", {})}
        reference.pop("chat_template_kwargs", None)
        expected = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, **reference),
                                    add_special_tokens=False)
        assert _post(server, "/tokenize", {"model": MODEL, "messages": messages, **options}).json()["tokens"] == expected
        reply = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 1, **options})
        assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == len(expected), reply.text
        prompts.append(expected)
    assert len(set(map(tuple, prompts))) == len(prompts)  # each option changed the prompt
    # add_special_tokens: the tokenizer's own (a BOS) on top of what the template places, off unless asked (vLLM's)
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    with_special = tokenizer.encode(text, add_special_tokens=True)
    assert len(with_special) > len(tokenizer.encode(text, add_special_tokens=False))
    tokens = _post(server, "/tokenize", {"model": MODEL, "messages": CHAT, "add_special_tokens": True}).json()["tokens"]
    assert tokens == with_special
    reply = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 1, "add_special_tokens": True})
    assert reply.json()["usage"]["prompt_tokens"] == len(with_special), reply.text
    for options, param in [({"continue_final_message": True}, "continue_final_message"),  # with the generation prompt
                           ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),
                           ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs")]:
        reply = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 1, **options})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_generation_config_defaults_fill_what_a_request_leaves_unset(start_server, tmp_path):
    """`--generation-config FOLDER` (vLLM's flag): its top_k 1 makes unset sampling the argmax, its
    max_new_tokens bounds a chat reply that sets no max_tokens; what a request sets still wins."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 1, "max_new_tokens": 5}))
    server = start_server("--disable-log-stats", "--generation-config", str(tmp_path))
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
    greedy = client.chat.completions.create(model="", messages=CHAT, temperature=0, max_tokens=5,
                                            extra_body={"ignore_eos": True})
    for _ in range(2):  # temperature 1 (unset), but top_k 1: the greedy reply
        reply = client.chat.completions.create(model="", messages=CHAT, extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 5 and reply.choices[0].message.content == greedy.choices[0].message.content
    wide = client.chat.completions.create(model="", messages=CHAT, max_tokens=9, seed=3,
                                          extra_body={"ignore_eos": True, "top_k": -1})
    assert wide.usage.completion_tokens == 9
