"""Load test of `llmc run`'s OpenAI server: throughput, TTFT and ITL at several concurrencies.

    python benchmarks/load_test.py [--base-url http://127.0.0.1:8000] [--artifact DIR]
        [--concurrency 1,4,16,64] [--num-requests 64] [--time-limit 60] [--max-tokens 32] [--json out.json]

Without `--base-url`, starts `llmc run` on a free loopback port (on `--artifact`, or on the
embedded ref-llama-12m built from recipes/ref-llama-12m.yaml into a temporary directory) and
stops it at the end. Loopback only: a non-local `--base-url` is refused.

For each concurrency C, `--num-requests` streaming completions (ignore_eos, so each generates
exactly `--max-tokens` tokens) are sent by C workers; a level stops issuing requests once it has
run `--time-limit` seconds. Per level it reports completed and failed requests, request and
output-token throughput, and the p50/p90/p99 of time to first token (TTFT), inter-token latency
(ITL: the gap between two streamed chunks) and end-to-end latency, in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
import numpy as np
import yaml

REPO_ROOT = Path(__file__).resolve().parent.parent
RECIPE = REPO_ROOT / "recipes" / "ref-llama-12m.yaml"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
PROMPTS = ("Once upon a time", "The old sailor said", "In the morning the village", "She opened the letter and",
           "The king of the north", "Under the bridge there was", "My grandmother told me that", "The rain fell on")


@dataclass
class RequestResult:
    ok: bool
    error: str = ""
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0


def build_reference_artifact(directory: Path) -> Path:
    from llmc.compiler.build import build
    from llmc.compiler.recipe import recipe_from_dict

    data = yaml.safe_load(RECIPE.read_text())
    data["model"] = str(REPO_ROOT / data["model"])
    data["output"] = str(directory / "artifact")
    return build(recipe_from_dict(data, source=str(RECIPE)), show_progress=False).output


def start_server(artifact: Path, log_path: Path, extra_args: list[str]) -> tuple[subprocess.Popen, str]:
    """`llmc run ARTIFACT` on a free loopback port; returns once /health answers 200."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-c", "from llmc.cli import main; main()", "run", str(artifact),
               "--port", str(port), "--disable-log-stats", *extra_args]
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}; see {log_path}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return process, base_url
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    process.kill()
    raise SystemExit(f"the server did not become healthy in 180 s; see {log_path}")


async def one_request(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as reply:
            if reply.status_code != 200:
                result.error = f"HTTP {reply.status_code}"
                return result
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if chunk.get("usage"):
                    result.num_output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.e2e_s = time.perf_counter() - start
    result.ok = last is not None
    return result


async def run_level(base_url: str, api_key: str | None, model: str, concurrency: int, num_requests: int,
                    max_tokens: int, time_limit_s: float) -> dict:
    """`num_requests` requests by `concurrency` workers, none started after `time_limit_s`."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    results: list[RequestResult] = []
    next_index = iter(range(num_requests))
    start = time.perf_counter()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=600, limits=limits) as client:
        async def worker() -> None:
            for index in next_index:
                if time.perf_counter() - start > time_limit_s:
                    return
                results.append(await one_request(client, model, PROMPTS[index % len(PROMPTS)], max_tokens))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return summarize(concurrency, results, time.perf_counter() - start)


def summarize(concurrency: int, results: list[RequestResult], duration_s: float) -> dict:
    done = [r for r in results if r.ok]
    itl = [gap for r in done for gap in r.itl_s]

    def percentiles(values: list[float]) -> dict:
        if not values:
            return {"p50": None, "p90": None, "p99": None}
        p50, p90, p99 = np.percentile(np.array(values) * 1000, [50, 90, 99])
        return {"p50": float(p50), "p90": float(p90), "p99": float(p99)}

    return {
        "concurrency": concurrency,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s,
        "output_token_throughput": sum(r.num_output_tokens for r in done) / duration_s,
        "ttft_ms": percentiles([r.ttft_s for r in done]),
        "itl_ms": percentiles(itl),
        "e2e_ms": percentiles([r.e2e_s for r in done]),
    }


def print_table(levels: list[dict]) -> None:
    def ms(value) -> str:
        return "-" if value is None else f"{value:.1f}"

    print(f"{'conc':>5}{'done':>6}{'fail':>6}{'req/s':>8}{'tok/s':>9}"
          f"{'TTFT p50':>10}{'p90':>8}{'p99':>8}{'ITL p50':>9}{'p90':>8}{'p99':>8}{'E2E p50':>9}{'p99':>9}")
    for r in levels:
        t, i, e = r["ttft_ms"], r["itl_ms"], r["e2e_ms"]
        print(f"{r['concurrency']:>5}{r['completed']:>6}{r['failed']:>6}{r['request_throughput']:>8.2f}"
              f"{r['output_token_throughput']:>9.1f}{ms(t['p50']):>10}{ms(t['p90']):>8}{ms(t['p99']):>8}"
              f"{ms(i['p50']):>9}{ms(i['p90']):>8}{ms(i['p99']):>8}{ms(e['p50']):>9}{ms(e['p99']):>9}")
    print("latencies in ms; ITL = gap between two streamed chunks of one request")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="a running server (loopback only); default: start one")
    parser.add_argument("--artifact", type=Path, help="artifact to serve when starting a server (default: build one)")
    parser.add_argument("--device", default="cpu", help="device of a started server")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    parser.add_argument("--concurrency", default="1,4,16,64", help="comma-separated concurrency levels")
    parser.add_argument("--num-requests", type=int, default=64, help="requests per level")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds per level before no new request starts")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    with ExitStack() as stack:
        base_url = args.base_url
        if base_url is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="llmc-load-")))
            artifact = args.artifact or build_reference_artifact(workdir)
            process, base_url = start_server(artifact, workdir / "server.log", ["--device", args.device])
            stack.callback(lambda: (process.terminate(), process.wait(60)))
        elif urlparse(base_url).hostname not in LOOPBACK_HOSTS:
            raise SystemExit(f"--base-url {base_url}: this load test only targets loopback servers")
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = args.model or httpx.get(f"{base_url}/v1/models", headers=headers).json()["data"][0]["id"]
        # Warm-up: first-request overheads stay out of the numbers.
        asyncio.run(run_level(base_url, args.api_key, model, 1, 2, 4, args.time_limit))
        results = [asyncio.run(run_level(base_url, args.api_key, model, c, args.num_requests, args.max_tokens,
                                         args.time_limit)) for c in levels]
    print(f"model {model}, {args.max_tokens} tokens per request, up to {args.num_requests} requests "
          f"or {args.time_limit:g} s per level")
    print_table(results)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if all(r["failed"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
