"""Bounded load test with disconnects against `llmc run` on loopback (issue 20).

    python benchmarks/load_disconnects.py [--artifact DIR] [--streams 128] [--rounds 3]
        [--disconnect-fraction 0.25] [--max-tokens 16] [--seed 0] [--server-args '...'] [--json out.json]

Starts `llmc run` on a free loopback port (on `--artifact`, or on ref-llama-12m built from
recipes/ref-llama-12m.yaml into a temporary directory), CPU unless `--device` says otherwise.
Each round sends `--streams` concurrent streaming completions; a `--disconnect-fraction` of them
(chosen at random) hang up at a random point: before the response starts (while the request is
queued or prefilling) or after a random number of streamed chunks. After each round it waits for
the server to drain and reads /metrics: `llmc:num_requests_running`, `llmc:num_requests_waiting`
and `llmc:kv_cache_usage_perc` must be back to 0; it records the server's resident memory (VmRSS).
A fixed greedy prompt is answered before the first round and after the last: identical text.

Pass criteria (exit 1 otherwise): 0 unexpected errors (a stream that was not cut by us must end
with a finish_reason and [DONE], no error event, status 200), every round drained to 0, greedy
text identical, resident memory growth from round 2 to round 3 below 5%.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from load_test import PROMPTS, build_reference_artifact, start_server  # the script directory is on sys.path

GREEDY = {"prompt": "ROMEO: my lord,", "max_tokens": 24, "temperature": 0}


async def one_stream(http: httpx.AsyncClient, index: int, cut_after: int | None, max_tokens: int, rng: random.Random
                     ) -> str | None:
    """One stream; returns None if it ended as expected, else what went wrong. `cut_after`: hang up
    after that many chunks (0: before the response starts), None: read to the end."""
    body = {"prompt": PROMPTS[index % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0.8,
            "seed": index, "ignore_eos": True, "stream": True}
    if cut_after == 0:
        try:  # hang up while the request is queued or prefilling
            async with asyncio.timeout(rng.uniform(0.0, 0.05)):
                async with http.stream("POST", "/v1/completions", json=body) as reply:
                    await reply.aread()
        except TimeoutError:
            return None
        return None  # finished before we hung up: fine too
    events = []
    async with http.stream("POST", "/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            return f"status {reply.status_code}: {(await reply.aread())[:200]!r}"
        lines = reply.aiter_lines()
        async for line in lines:
            if not line.startswith("data: "):
                continue
            events.append(line[len("data: "):])
            if cut_after is not None and len(events) >= cut_after:
                return None  # leaving the block closes the connection mid-stream
    if not events or events[-1] != "[DONE]":
        return f"no [DONE] (last event {events[-1:]!r})"
    last = json.loads(events[-2])
    if "error" in last:
        return f"error event: {last['error']}"
    if last["choices"][0]["finish_reason"] != "length":
        return f"finish_reason {last['choices'][0]['finish_reason']!r}"
    return None


def read_metrics(base_url: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{base_url}/metrics", timeout=10).text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def resident_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def run_round(base_url: str, args, rng: random.Random) -> dict:
    cut = {i: (rng.choice([0, rng.randint(1, args.max_tokens)]))
           for i in rng.sample(range(args.streams), int(args.streams * args.disconnect_fraction))}
    limits = httpx.Limits(max_connections=args.streams + 8)
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as http:
        results = await asyncio.gather(*(one_stream(http, i, cut.get(i), args.max_tokens, rng)
                                         for i in range(args.streams)), return_exceptions=True)
    errors = [repr(r) if isinstance(r, BaseException) else r for r in results if r is not None]
    return {"seconds": round(time.monotonic() - start, 2), "disconnected": len(cut),
            "cut_before_response": sum(1 for k in cut.values() if k == 0), "unexpected_errors": errors}


def wait_drained(base_url: str, timeout: float = 60) -> dict[str, float]:
    names = ("llmc:num_requests_running", "llmc:num_requests_waiting", "llmc:kv_cache_usage_perc")
    deadline = time.monotonic() + timeout
    while True:
        metrics = read_metrics(base_url)
        drained = {name: metrics.get(name, -1.0) for name in names}
        if all(v == 0 for v in drained.values()) or time.monotonic() > deadline:
            return drained
        time.sleep(0.1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--disconnect-fraction", type=float, default=0.25)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-args", default="", help="more `llmc run` flags, e.g. '--num-kv-blocks 40' to force preemptions")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        artifact = args.artifact or build_reference_artifact(Path(tmp))
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.pop("LLMC_CHECK_INVARIANTS", None)  # measure the default server
        server, base_url = start_server(Path(artifact), Path(tmp) / "server.log", ["--device", args.device, *args.server_args.split()])
        try:
            report = drive(server, base_url, args)
        finally:
            server.terminate()
            server.wait(60)
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


def drive(server: subprocess.Popen, base_url: str, args) -> dict:
    greedy = lambda: httpx.post(f"{base_url}/v1/completions", json=GREEDY, timeout=60).json()["choices"][0]["text"]
    before, rng, rounds = greedy(), random.Random(args.seed), []
    for _ in range(args.rounds):
        result = asyncio.run(run_round(base_url, args, rng))
        result["after"] = wait_drained(base_url)
        result["rss_mib"] = round(resident_mib(server.pid), 1)
        result["preemptions_so_far"] = read_metrics(base_url).get("llmc:num_preemptions_total", 0.0)
        rounds.append(result)
        print(json.dumps(result), file=sys.stderr)
    after = greedy()
    growth = (rounds[-1]["rss_mib"] - rounds[-2]["rss_mib"]) / rounds[-2]["rss_mib"] if len(rounds) > 1 else 0.0
    passed = (all(not r["unexpected_errors"] and all(v == 0 for v in r["after"].values()) for r in rounds)
              and before == after and growth < 0.05)
    return {"streams": args.streams, "rounds": rounds, "greedy_identical": before == after,
            "rss_growth_last_round": round(growth, 4), "passed": passed}


if __name__ == "__main__":
    sys.exit(main())
