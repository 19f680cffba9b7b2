"""TTFT of short requests while long prompts keep arriving: `llmc run --tokenizer-pool-size` 0 vs N.

    python -P benchmarks/bench_tokenizer_pool.py --artifact DIR [--pool-sizes 0,4] [--num-short 40]
        [--long-tokens 8192] [--long-workers 2]

For each pool size, starts `llmc run` on a free loopback port, then `--long-workers` clients send
completions whose prompts are `--long-tokens` tokens of text back to back while one client sends
`--num-short` short streaming completions (4 tokens) one after another; reports the short
requests' time to first token, p50 and p99 in ms. The long prompts are longer than the artifact's
max_model_len, so the server tokenizes each and refuses it (400 context_length_exceeded): the load
they add is tokenization alone, which is what the pool moves off the event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time

import httpx
import numpy as np

WORDS = "but soft what light through yonder window breaks it is the east and juliet is the sun".split()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(artifact: str, pool_size: int) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-P", "-m", "llmc.cli", "run", artifact, "--port", str(port),
                                "--tokenizer-pool-size", str(pool_size), "--disable-log-stats"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return process, base
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError("the server did not start")


async def _long_sender(client: httpx.AsyncClient, base: str, text: str, stop: asyncio.Event) -> int:
    sent = 0
    while not stop.is_set():
        await client.post(f"{base}/v1/completions", json={"prompt": text, "max_tokens": 4})
        sent += 1
    return sent


async def _short_ttft(client: httpx.AsyncClient, base: str) -> float:
    start = time.perf_counter()
    body = {"prompt": "ROMEO:", "max_tokens": 4, "stream": True, "temperature": 0}
    async with client.stream("POST", f"{base}/v1/completions", json=body) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - start
    raise RuntimeError("no token streamed")


async def _measure(base: str, long_text: str, num_short: int, long_workers: int) -> dict:
    async with httpx.AsyncClient(timeout=120) as client:
        await _short_ttft(client, base)  # warm up
        stop = asyncio.Event()
        senders = [asyncio.create_task(_long_sender(client, base, long_text, stop)) for _ in range(long_workers)]
        await asyncio.sleep(0.5)
        ttfts = [await _short_ttft(client, base) for _ in range(num_short)]
        stop.set()
        num_long = sum(await asyncio.gather(*senders))
    ms = np.array(ttfts) * 1e3
    return {"ttft_p50_ms": round(float(np.percentile(ms, 50)), 1), "ttft_p99_ms": round(float(np.percentile(ms, 99)), 1),
            "num_short": num_short, "num_long_sent": num_long}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--artifact", required=True)
    parser.add_argument("--pool-sizes", default="0,4")
    parser.add_argument("--num-short", type=int, default=40)
    parser.add_argument("--long-tokens", type=int, default=8192)
    parser.add_argument("--long-workers", type=int, default=2)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(f"{args.artifact}/tokenizer")
    words = " ".join(WORDS[i % len(WORDS)] for i in range(2 * args.long_tokens))
    long_text = tokenizer.decode(tokenizer.encode(words, add_special_tokens=False)[: args.long_tokens])
    num_tokens = len(tokenizer.encode(long_text))
    for size in (int(s) for s in args.pool_sizes.split(",")):
        process, base = _start(args.artifact, size)
        try:
            result = asyncio.run(_measure(base, long_text, args.num_short, args.long_workers))
        finally:
            process.terminate()
            process.wait()
        print(json.dumps({"tokenizer_pool_size": size, "long_prompt_tokens": num_tokens, **result}), flush=True)


if __name__ == "__main__":
    main()
