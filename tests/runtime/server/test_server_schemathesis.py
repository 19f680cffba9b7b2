"""A longer fuzz (marked slow): schemathesis generates requests from the server's own /openapi.json
(valid ones and, in negative mode, ones that break the schema) for every endpoint; none may get a
5xx, and the server answers a fixed greedy prompt identically afterwards.

    python -m pytest -m slow tests/runtime/server/test_server_schemathesis.py   (needs schemathesis)
"""

from __future__ import annotations

import os
import time

import httpx
import pytest

from llmc.runtime.engine import Engine
from llmc.runtime.server.api_server import build_app

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

GREEDY = {"prompt": "ROMEO: my lord,", "max_tokens": 12, "temperature": 0}
EXAMPLES_PER_OPERATION = int(os.environ.get("LLMC_SCHEMATHESIS_EXAMPLES", "300"))


def _bound(body) -> None:
    """Keep a generated request cheap to serve (absurd values stay: they must be 4xx): at most 8
    tokens (chat defaults to the whole context) and 4 sequences."""
    if not isinstance(body, dict) or "messages" not in body and "prompt" not in body:
        return
    for name, cap in (("max_tokens", 8), ("max_completion_tokens", 8), ("n", 4), ("best_of", 4)):
        value = body.get(name)
        if value is None and name == "max_tokens":
            body[name] = cap
        elif isinstance(value, int) and not isinstance(value, bool) and cap < value <= 1024:
            body[name] = cap


@pytest.mark.slow
def test_schemathesis_finds_no_5xx(run_app, server_artifact):
    base_url = run_app(build_app(lambda: Engine(server_artifact, device="cpu"), "m", log_stats=False))
    deadline = time.monotonic() + 60
    while httpx.get(f"{base_url}/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    before = httpx.post(f"{base_url}/v1/completions", json=GREEDY, timeout=60).json()["choices"][0]["text"]
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    modes = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
    for path, method in (("/v1/completions", "POST"), ("/v1/chat/completions", "POST"), ("/tokenize", "POST"),
                         ("/detokenize", "POST"), ("/v1/models", "GET"), ("/v1/responses", "POST")):
        operation = schema[path][method]

        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=schemathesis.GenerationMode.POSITIVE)
               | operation.as_strategy(generation_mode=modes[1]))
        def check(case):
            _bound(case.body)
            case.call_and_validate(base_url=base_url, checks=[not_a_server_error])

        check()
    after = httpx.post(f"{base_url}/v1/completions", json=GREEDY, timeout=60).json()["choices"][0]["text"]
    assert after == before
