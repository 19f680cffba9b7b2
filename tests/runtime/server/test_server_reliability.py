"""One bad request never wedges the server: the reported attacks are 4xx and the server answers a
fixed greedy prompt identically afterwards; a hypothesis fuzz over the request bodies gets no 5xx;
admission is bounded (--max-waiting counts sequences and seats); /health turns 503 when the engine
stops stepping; /v1/models shows no path."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmc.runtime.engine import Engine
from llmc.runtime.server.api_server import MAX_BODY_BYTES, build_app
from llmc.runtime.server.protocol import MAX_N, MAX_PROMPTS

GREEDY = {"prompt": "ROMEO: my lord,", "max_tokens": 12, "temperature": 0}
LONG = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "temperature": 0.8}


def _serve(run_app, server_artifact, **options) -> str:
    engine_options = options.pop("engine", {})
    app = build_app(lambda: Engine(server_artifact, device="cpu", **engine_options), "m", log_stats=False, **options)
    base_url = run_app(app, wait_healthy=True)
    return base_url


def _greedy(http: httpx.Client) -> str:
    reply = http.post("/v1/completions", json=GREEDY)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


BAD_BODIES = [
    ({"prompt": "x", "n": 3000000, "temperature": 1}, "n"),
    ({"prompt": "x", "top_k": 2**70}, "top_k"),
    ({"prompt": "x", "logit_bias": {"²": 5}}, "logit_bias"),
    ({"prompt": "x", "best_of": MAX_N + 1, "temperature": 1}, "best_of"),
    ({"prompt": "x", "max_tokens": 2**70}, "max_tokens"),
    ({"prompt": ["x"] * (MAX_PROMPTS + 1)}, "prompt"),
    ({"prompt": "x", "stop": ["a"] * 65}, "stop"),
    ({"prompt": "x", "stop": "a" * 5000}, "stop"),
    ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(2000)}}, "logit_bias"),
    ({"prompt": "x", "min_tokens": 2**64}, "min_tokens"),
]


def test_reported_attacks_are_client_errors_and_the_server_keeps_serving(run_app, server_artifact):
    base_url = _serve(run_app, server_artifact)
    with httpx.Client(base_url=base_url, timeout=60) as http:
        before = _greedy(http)
        for body, param in BAD_BODIES:
            reply = http.post("/v1/completions", json=body)
            assert reply.status_code == 400, (body, reply.text)
            assert reply.json()["error"]["param"] == param, reply.text
        headers = {"content-type": "application/json"}
        raw_attacks = [
            ("/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 2}'),
            ("/v1/completions", b'{"prompt": "x", "stop": ["\\udfff"], "max_tokens": 2}'),
            ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}'),
            ("/tokenize", b'{"prompt": "\\ud800"}'),
            ("/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"),
            ("/v1/completions", b'{"prompt": "x", "user": ' + b"[" * 100 + b"]" * 100 + b"}"),
        ]
        for path, raw in raw_attacks:
            reply = http.post(path, content=raw, headers=headers)
            assert reply.status_code == 400, (raw[:60], reply.text)
        big = b'{"prompt": "' + b"a" * (MAX_BODY_BYTES + 1) + b'"}'
        assert http.post("/v1/completions", content=big, headers=headers).status_code == 413
        models = http.get("/v1/models").json()["data"][0]
        assert str(server_artifact) not in json.dumps(models) and "/" not in models["root"]
        assert _greedy(http) == before
        assert http.get("/health").status_code == 200


_JUNK = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=2**60, max_value=2**80),
                  st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                  st.lists(st.integers(min_value=-5, max_value=5000), max_size=4),
                  st.dictionaries(st.text(max_size=4), st.integers(), max_size=3))
_SMALL_INT = st.integers(min_value=0, max_value=3)
# Mostly valid values per field (the edges of their ranges included); a drawn body then gets at most
# two fields replaced by anything (_JUNK): each request is near a valid one, so both sides are explored.
_FIELDS = {
    "n": st.integers(1, 2), "best_of": st.integers(2, 3), "max_tokens": st.integers(1, 3),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 2**40),
    "min_p": st.floats(0, 1), "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=3)),
    "logit_bias": st.dictionaries(st.integers(0, 4095).map(str), st.floats(-100, 100), max_size=3),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "min_tokens": _SMALL_INT, "logprobs": _SMALL_INT,
    "prompt_logprobs": _SMALL_INT, "stop_token_ids": st.lists(st.integers(0, 4095), max_size=3),
    "allowed_token_ids": st.lists(st.integers(0, 4095), min_size=1, max_size=3), "echo": st.booleans(),
    "stream": st.booleans(), "truncate_prompt_tokens": st.integers(1, 8), "priority": st.integers(-5, 5),
    "ignore_eos": st.booleans(), "include_stop_str_in_output": st.booleans(), "skip_special_tokens": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": st.text(max_size=4), "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "x"])}),
}
_PROMPTS = st.one_of(st.text(min_size=1, max_size=12), st.lists(st.integers(0, 4095), min_size=1, max_size=6),
                     st.lists(st.text(min_size=1, max_size=6), min_size=1, max_size=3))
_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system"]),
                                            "content": st.text(max_size=12)}), min_size=1, max_size=3)
_FEW = {name: _FIELDS[name] for name in ("n", "temperature", "top_p", "top_k", "seed", "stop", "logprobs",
                                         "stream", "ignore_eos", "min_tokens", "logit_bias", "echo")}


@st.composite
def _body(draw, path: str) -> dict:
    fields = _FEW if draw(st.booleans()) else _FIELDS
    if path == "/v1/completions":
        body = draw(st.fixed_dictionaries({"prompt": _PROMPTS}, optional=fields))
    else:
        optional = {k: v for k, v in fields.items() if k not in ("echo", "logprobs", "prompt_logprobs", "max_tokens")}
        body = draw(st.fixed_dictionaries({"messages": _MESSAGES, "max_tokens": st.integers(1, 3)}, optional=optional))
    for name in draw(st.lists(st.sampled_from(sorted(body) + ["model", "messages", "prompt"]), max_size=2)):
        body[name] = draw(_JUNK)
    if isinstance(body.get("max_tokens"), int) and 3 < body["max_tokens"] < 2**63:
        body["max_tokens"] = 3  # keep the run short (absurd values stay: they must be a 400)
    return body


@pytest.mark.slow  # 15 s on 2 cores; the schemathesis fuzz (also slow) covers every route
def test_fuzzed_requests_get_no_5xx_and_change_nothing(run_app, server_artifact):
    base_url = _serve(run_app, server_artifact)
    http = httpx.Client(base_url=base_url, timeout=60)
    before = _greedy(http)
    statuses: dict[int, int] = {}

    @settings(max_examples=200, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]), data=st.data())
    def check(path, data):
        body = data.draw(_body(path))
        reply = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        statuses[reply.status_code] = statuses.get(reply.status_code, 0) + 1
        assert reply.status_code < 500, (path, body, reply.text)
        if body.get("stream") is True and reply.status_code == 200:
            assert '"type": "server_error"' not in reply.text, (body, reply.text)

    try:
        check()
        assert statuses.get(200, 0) > 10 and statuses.get(400, 0) > 10, statuses  # both sides were explored
        assert _greedy(http) == before
        stats = httpx.get(f"{base_url}/metrics").text
        assert "llmc:num_requests_running" in stats
    finally:
        http.close()


async def _stream_first_line(http: httpx.AsyncClient, body: dict, events: list, hold: asyncio.Event) -> int:
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
        if reply.status_code != 200:
            events.append(reply.status_code)
            return reply.status_code
        lines = reply.aiter_lines()  # kept open: a dropped line iterator closes the connection
        while not (await lines.__anext__()).startswith("data: "):
            pass
        events.append(200)
        await hold.wait()
        return 200


def test_max_waiting_counts_seats_and_sequences(run_app, server_artifact):
    base_url = _serve(run_app, server_artifact, max_waiting=4, engine={"max_num_seqs": 4})

    async def burst() -> list[int]:
        hold, events = asyncio.Event(), []
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
            tasks = [asyncio.create_task(_stream_first_line(http, LONG, events, hold)) for _ in range(16)]
            deadline = time.monotonic() + 60
            while len(events) < 16 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            hold.set()
            return await asyncio.gather(*tasks)

    # Streams send their first event once queued; refused ones answer 503 at once. Seated or queued: 8.
    codes = asyncio.run(burst())
    assert sorted(codes).count(200) == 8 and codes.count(503) == 8, codes
    with httpx.Client(base_url=base_url, timeout=60) as http:
        never = http.post("/v1/completions", json={"prompt": "x", "n": 9, "temperature": 1, "max_tokens": 2})
        assert never.status_code == 400 and "never" in never.json()["error"]["message"], never.text
        assert never.json()["error"]["param"] == "n"
        fits = http.post("/v1/completions", json={"prompt": "x", "n": 5, "temperature": 1, "max_tokens": 2})
        assert fits.status_code == 200, fits.text  # idle: 4 seats + 1 waiting


def test_max_waiting_0_admits_while_seats_are_free(run_app, server_artifact):
    base_url = _serve(run_app, server_artifact, max_waiting=0, engine={"max_num_seqs": 2})
    with httpx.Client(base_url=base_url, timeout=60) as http:
        assert http.post("/v1/completions", json={"prompt": "x", "n": 2, "temperature": 1, "max_tokens": 2}
                         ).status_code == 200
        refused = http.post("/v1/completions", json={"prompt": "x", "n": 3, "temperature": 1, "max_tokens": 2})
        assert refused.status_code == 400


def test_health_is_503_while_the_engine_is_wedged(run_app, server_artifact):
    release, entered = threading.Event(), threading.Event()

    class WedgingEngine(Engine):
        def step(self):
            if not release.is_set():
                entered.set()
                release.wait(30)
            return super().step()

    app = build_app(lambda: WedgingEngine(server_artifact, device="cpu"), "m", log_stats=False, stall_timeout_s=0.5)
    base_url = run_app(app, wait_healthy=True)
    result = {}
    thread = threading.Thread(target=lambda: result.update(
        reply=httpx.post(f"{base_url}/v1/completions", json=GREEDY, timeout=60)))
    thread.start()
    assert entered.wait(30)
    time.sleep(0.8)
    health = httpx.get(f"{base_url}/health")
    assert health.status_code == 503 and "one step" in health.json()["error"]["message"]
    release.set()
    thread.join(60)
    assert result["reply"].status_code == 200
    assert httpx.get(f"{base_url}/health").status_code == 200


def test_a_failing_request_is_a_500_naming_it_and_the_others_finish(run_app, server_artifact, monkeypatch,
                                                                    read_metrics):
    from llmc.runtime.request_state import SequenceState

    boom = [0, 77, 77, 77, 77]  # this prompt's detokenization raises
    original = SequenceState.add_tokens

    def add_tokens(self, token_ids):
        if self.request.prompt_token_ids == boom and self.request.num_output_tokens >= 2:
            raise RuntimeError("injected detokenizer failure")
        original(self, token_ids)

    base_url = _serve(run_app, server_artifact)
    with httpx.Client(base_url=base_url, timeout=60) as http:
        before = _greedy(http)
        monkeypatch.setattr(SequenceState, "add_tokens", add_tokens)
        results = {}
        threads = [threading.Thread(target=lambda: results.update(good=_greedy(http)))]
        threads[0].start()
        failed = http.post("/v1/completions", json={"prompt": boom, "max_tokens": 8})
        streamed = http.post("/v1/completions", json={"prompt": boom, "max_tokens": 8, "stream": True})
        threads[0].join(60)
        assert failed.status_code == 500, failed.text
        message = failed.json()["error"]["message"]
        assert "injected detokenizer failure" in message and "cmpl-" in message  # names the request
        events = [line[len("data: "):] for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "server_error"
        assert results["good"] == before == _greedy(http)
    metrics = read_metrics(base_url)
    assert metrics["llmc:num_requests_running"] == 0 and metrics["llmc:kv_cache_usage_perc"] == 0
