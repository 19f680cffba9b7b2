"""Data parallelism: engine replicas behind one server, each request to the least loaded replica;
and a server whose parallel engine loses a rank stops with the rank's name."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import WorkerError
from llmc.runtime.engine import Engine
from llmc.runtime.server.api_server import build_app


class GatedEngine(Engine):
    """An engine whose steps wait for the test to open the gate: requests stay unfinished meanwhile."""

    gate = threading.Event()

    def step(self):
        assert self.gate.wait(30)
        return super().step()


def test_requests_go_to_the_least_loaded_replica(run_app, server_artifact, read_metrics):
    GatedEngine.gate.clear()
    factories = [lambda: GatedEngine(server_artifact, device="cpu", disable_log_stats=True) for _ in range(2)]
    app = build_app(factories, "m", log_stats=False)
    router = app.state.ctx.engine_loop
    base_url = run_app(app, wait_healthy=True)
    body = {"max_tokens": 4, "temperature": 0}
    with ThreadPoolExecutor(3) as pool:
        replies = [pool.submit(httpx.post, f"{base_url}/v1/completions", json={**body, "prompt": p}, timeout=60)
                   for p in ("ROMEO:", "JULIET:", "First Citizen:")]
        deadline = time.monotonic() + 10
        while sum(router.num_unfinished(i) for i in range(2)) < 3:
            assert time.monotonic() < deadline, "the requests were not added"
            time.sleep(0.02)
        assert sorted(router.num_unfinished(i) for i in range(2)) == [1, 2]  # never 3 on one and 0 on the other
        GatedEngine.gate.set()
        assert all(r.result().status_code == 200 for r in replies)
    assert [router.num_unfinished(i) for i in range(2)] == [0, 0]
    queries = sum(replica.engine.stats()["prefix_cache_queries"] for replica in router.replicas)
    assert queries > 0 and read_metrics(base_url)["llmc:prefix_cache_queries_total"] == queries  # summed


@pytest.fixture(scope="module")
def parallel_artifact(tmp_path_factory, ref_model_dir):
    out = tmp_path_factory.mktemp("dp") / "t1p2"
    build(recipe_from_dict({"model": str(ref_model_dir), "output": str(out), "dtype": "float32",
                            "parallel": {"pipeline": 2}, "runtime": {"max_model_len": 256, "num_kv_blocks": 64}}),
          show_progress=False)
    return out


@pytest.mark.slow  # 5 s on 2 cores
def test_each_replica_runs_its_own_ranks(run_app, parallel_artifact):
    engines = []

    def factory():
        engines.append(Engine(parallel_artifact, device="cpu", disable_log_stats=True))
        return engines[-1]

    base_url = run_app(build_app([factory, factory], "m", log_stats=False), wait_healthy=True)
    pids = [set(engine.runner.worker_pids.values()) for engine in engines]
    assert len(pids[0]) == len(pids[1]) == 1 and not pids[0] & pids[1]
    reply = httpx.post(f"{base_url}/v1/completions", json={"prompt": ["ROMEO:", "JULIET:"], "max_tokens": 4}, timeout=60)
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 2


def _serve_and_kill_rank_1(run_app, parallel_artifact) -> tuple[str, list]:
    """A server of the pipeline-2 artifact, its rank 1 killed; (base url, what on_fatal was told)."""
    engines, fatal = [], []

    def factory():
        engines.append(Engine(parallel_artifact, device="cpu", disable_log_stats=True))
        return engines[-1]

    base_url = run_app(build_app(factory, "m", log_stats=False, on_fatal=fatal.append), wait_healthy=True)
    os.kill(engines[0].runner.worker_pids[1], signal.SIGKILL)
    return base_url, fatal


def test_a_dead_rank_fails_the_request_and_stops_the_server(run_app, parallel_artifact):
    base_url, fatal = _serve_and_kill_rank_1(run_app, parallel_artifact)
    reply = httpx.post(f"{base_url}/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 4}, timeout=60)
    assert reply.status_code == 500
    assert "rank 1 (pipeline stage 1, tensor rank 0) was killed by signal SIGKILL" in reply.json()["error"]["message"]
    assert len(fatal) == 1 and isinstance(fatal[0], WorkerError)  # `serve` stops uvicorn and raises it


def test_a_rank_that_dies_while_the_server_is_idle_fails_health_and_stops_it(run_app, parallel_artifact):
    """No step runs to find it: the pool's watchdog records the death, and the health check (the server's
    watchdog polls it) marks the engine down and stops the server, instead of answering 200 until the next
    request fails."""
    base_url, fatal = _serve_and_kill_rank_1(run_app, parallel_artifact)
    deadline = time.monotonic() + 20
    while (health := httpx.get(f"{base_url}/health", timeout=10)).status_code == 200:
        assert time.monotonic() < deadline, "/health still answers 200"
        time.sleep(0.2)
    assert health.status_code == 503 and "killed by signal SIGKILL" in health.text
    assert len(fatal) == 1 and isinstance(fatal[0], WorkerError)
    reply = httpx.post(f"{base_url}/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 4}, timeout=60)
    assert reply.status_code == 500 and "rank 1" in reply.json()["error"]["message"] and len(fatal) == 1


def test_replica_statistics_are_rates_of_the_summed_counters():
    """A router's hit rate is hits / queries over every replica (was the mean of the replicas' rates, so
    one busy replica's 61.5% read 30.8%); KV usage weighs each replica by its blocks."""
    from llmc.runtime.server.router import ReplicaRouter

    class Loop:
        def __init__(self, stats):
            self.stats = stats

    busy = {"prefix_cache_hits": 96, "prefix_cache_queries": 156, "prefix_cache_hit_rate": 96 / 156,
            "num_spec_accepted": 3, "num_spec_proposed": 4, "spec_acceptance_rate": 0.75,
            "kv_cache_usage": 0.5, "num_total_blocks": 300, "num_running": 2}
    idle = {"prefix_cache_hits": 0, "prefix_cache_queries": 0, "prefix_cache_hit_rate": 0.0, "num_spec_accepted": 0,
            "num_spec_proposed": 0, "spec_acceptance_rate": 0.0, "kv_cache_usage": 0.0, "num_total_blocks": 100,
            "num_running": 0}
    stats = ReplicaRouter([Loop(busy), Loop(idle)]).stats
    assert stats["prefix_cache_hit_rate"] == 96 / 156 and stats["spec_acceptance_rate"] == 0.75
    assert stats["kv_cache_usage"] == 0.5 * 300 / 400 and stats["num_running"] == 2
