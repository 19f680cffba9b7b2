"""Latency under a steady arrival of requests (an interactive server's load), per CUDA-graph mode.

    source benchmarks/gpu_env.sh && R=$PWD && cd /tmp && python $R/benchmarks/interactive_load.py \\
        /tmp/bf16=bf16 --modes FULL_DECODE_ONLY FULL_AND_PIECEWISE --rate 8 --requests 160 --json $OUT/load.json

Requests of --prompt random token ids and exactly --output new tokens (greedy, ignore_eos, streamed as
deltas) arrive at the Engine at exponential gaps of mean 1 / --rate seconds (the same seeded arrival times
and prompts for every mode); the loop adds each request once its time has come and steps the engine
while any is unfinished. Unlike bench_e2e's throughput part (everything submitted at once, steps of
thousands of tokens), most steps here are decodes beside one new prompt: mixed steps of a few hundred
tokens, which FULL_AND_PIECEWISE replays as piecewise graphs and FULL_DECODE_ONLY runs eagerly. Every
token is stamped with the time its step returned: TTFT (first token − arrival) and ITL (gaps between a
request's consecutive tokens) p50/p90/p99, and the output tokens/s over the run.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import percentiles, random_prompts, release_memory, warm_up  # noqa: E402

from llmc.runtime.llm import LLM  # noqa: E402
from llmc.runtime.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402


def run_load(engine, prompts: list[list[int]], arrivals: list[float], output_tokens: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    stamps: dict[str, list[float]] = {}
    arrived: dict[str, float] = {}
    start, next_request = time.perf_counter(), 0
    while next_request < len(prompts) or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while next_request < len(prompts) and arrivals[next_request] <= now:
            request_id = engine.add_request(None, params, prompts[next_request])
            stamps[request_id], arrived[request_id] = [], start + arrivals[next_request]
            next_request += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[next_request] - now))
            continue
        outputs = engine.step()
        stepped = time.perf_counter()
        for output in outputs:
            stamps[output.request_id].extend([stepped] * len(output.outputs[0].token_ids))
    elapsed = time.perf_counter() - start
    ttft = [times[0] - arrived[request_id] for request_id, times in stamps.items() if times]
    itl = [b - a for times in stamps.values() for a, b in zip(times, times[1:])]
    return {"elapsed_s": round(elapsed, 3), "output_tokens_per_s": round(sum(map(len, stamps.values())) / elapsed, 1),
            "ttft_ms": percentiles(ttft), "itl_ms": percentiles(itl)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("artifacts", nargs="+", help="ARTIFACT[=LABEL]")
    parser.add_argument("--modes", nargs="+", default=["FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"],
                        help="compilation_config.cudagraph_mode of each run, in order (repeat one for a second round)")
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second (mean)")
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    arrivals, t = [], 0.0
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        arrivals.append(t)
    report = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "args": vars(args) | {
        "json": str(args.json)}, "runs": []}
    for spec in args.artifacts:
        path, _, label = spec.partition("=")
        for mode in args.modes:
            llm = LLM(path, max_num_seqs=args.max_num_seqs, disable_log_stats=True,
                      compilation_config={"cudagraph_mode": mode})
            warm_up(llm.engine, 32, args.prompt)
            prompts = random_prompts(args.requests, args.prompt, llm.engine.manifest.model.vocab_size, args.seed)
            result = {"label": label or path, "mode": mode, **run_load(llm.engine, prompts, arrivals, args.output)}
            pieces = getattr(llm.engine.runner, "pieces", None)
            result["piecewise_replays"] = None if pieces is None else pieces.num_replays
            del pieces
            report["runs"].append(result)
            print(json.dumps(result), flush=True)
            llm.close()
            del llm
            release_memory(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
            if args.json:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
