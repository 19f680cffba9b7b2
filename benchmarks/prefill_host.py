"""Time to first token of one short request, and what the host does meanwhile in its prefill step.

    source benchmarks/gpu_env.sh && R=$PWD && cd /tmp && python $R/benchmarks/prefill_host.py \\
        /tmp/w4=w4a16 /tmp/bf16=bf16 --prompt-lens 16 128 512 --json $OUT/prefill_host.json \\
        --modes FULL_DECODE_ONLY FULL_AND_PIECEWISE     # the step eager, then through the piecewise graphs

Each ARTIFACT[=LABEL] is loaded with `LLM`; after a warm-up, for each prompt length, --repeats requests of
that many random token ids and max_tokens 1 run one at a time (new ids each time, so the prefix cache
holds none of them). Per request: the wall time from `add_request` to its output (TTFT as a client of an
idle engine sees it); on CUDA, under torch.profiler for --profiled requests, the time some kernel ran and
the number of kernels; then cProfile over the same number of requests: the host functions by own time
(--top), and the host time per call of the GEMM entry points. A TTFT well above the kernel time is host
time the GPU waited for: an eager step launches every kernel from Python (FULL_DECODE_ONLY); the piecewise
graphs (FULL_AND_PIECEWISE, the default) launch only the attention between graph replays.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import random_prompts, release_memory  # noqa: E402
from profile_step import busy_us, kernel_events  # noqa: E402

from llmc.runtime.llm import LLM  # noqa: E402
from llmc.runtime.sampling_params import SamplingParams  # noqa: E402

WATCHED = ("w4a16_linear", "w4a16_silu_mul", "fp8_matmul", "linear", "paged_attention", "rms_norm", "launch_tiled",
           "run_w4a16_config", "launch_w4a16_wgmma", "launch_w4a16_ws", "quantize_fp8_per_token",
           "select_w4a16_config", "plan_splits", "run")  # functions whose per-call host time is reported


def one_request(engine, prompt: list[int]) -> float:
    start = time.perf_counter()
    engine.add_request(None, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), prompt)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def measure(engine, length: int, args, seed: int) -> dict:
    vocab_size = engine.manifest.model.vocab_size
    prompts = iter(random_prompts(args.repeats + 2 * args.profiled + 2, length, vocab_size, seed))
    for _ in range(2):
        one_request(engine, next(prompts))
    walls = [one_request(engine, next(prompts)) * 1000 for _ in range(args.repeats)]
    result = {"prompt_tokens": length, "ttft_ms_median": round(statistics.median(walls), 3),
              "ttft_ms_min": round(min(walls), 3), "ttft_ms": [round(w, 3) for w in walls]}
    if torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.profiled):
                one_request(engine, next(prompts))
            torch.cuda.synchronize()
        events = kernel_events(prof)
        result["kernel_ms"] = round(busy_us(events) / 1000 / args.profiled, 3)
        result["kernels_per_request"] = round(len(events) / args.profiled, 1)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.profiled):
        one_request(engine, next(prompts))
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = [(func, cc, nc, tt, ct) for func, (cc, nc, tt, ct, _) in stats.stats.items()]
    rows.sort(key=lambda row: row[3], reverse=True)
    label = lambda func: f"{Path(func[0]).name}:{func[1]}:{func[2]}"  # noqa: E731
    per = args.profiled
    result["host_top"] = [{"function": label(f), "calls": round(nc / per, 1), "own_ms": round(tt * 1000 / per, 3),
                           "cum_ms": round(ct * 1000 / per, 3)} for f, cc, nc, tt, ct in rows[:args.top]]
    result["host_per_call_us"] = {label(f): {"calls": round(nc / per, 1), "cum_us_per_call": round(ct * 1e6 / nc, 1)}
                                  for f, cc, nc, tt, ct in rows if f[2] in WATCHED and nc}
    result["host_total_ms"] = round(sum(row[3] for row in rows) * 1000 / per, 3)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("artifacts", nargs="+", help="ARTIFACT[=LABEL]")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[16, 128, 512])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--profiled", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--modes", nargs="+", default=[None], metavar="CUDAGRAPH_MODE",
                        help="compilation_config.cudagraph_mode of each run (e.g. FULL_DECODE_ONLY FULL_AND_PIECEWISE, "
                             "alternating per artifact); default: the artifact's")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    report = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "results": {}}
    for spec, mode in [(spec, mode) for spec in args.artifacts for mode in args.modes]:
        path, _, label = spec.partition("=")
        label = (label or path) + (f"/{mode}" if mode else "")
        graphs = {"compilation_config": {"cudagraph_mode": mode}} if mode else {}
        llm = LLM(path, device=args.device, max_num_seqs=16, disable_log_stats=True, **graphs)
        if getattr(llm.engine.runner, "pieces", None) is not None:  # no local: the next LLM needs this one's memory
            print(f"{label}: graphs of prefill steps (piecewise, or whole under FULL) of "
                  f"{llm.engine.runner.pieces.sizes} tokens captured in "
                  f"{llm.engine.runner.pieces.capture_seconds:.1f} s, {llm.engine.runner.pieces.graph_bytes / 2**20:.0f} "
                  "MiB", flush=True)
        rows = [measure(llm.engine, length, args, seed=length) for length in args.prompt_lens]
        report["results"][label] = rows
        for row in rows:
            print(f"{label} prompt {row['prompt_tokens']}: TTFT median {row['ttft_ms_median']} ms "
                  f"(min {row['ttft_ms_min']}), kernels {row.get('kernel_ms')} ms in {row.get('kernels_per_request')} "
                  f"launches, host (cProfile) {row['host_total_ms']} ms", flush=True)
            for top in row["host_top"][:12]:
                print(f"    {top}")
            for name, value in row["host_per_call_us"].items():
                print(f"    per call {name}: {value}")
        llm.close()
        del llm
        release_memory(torch.device(args.device))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
