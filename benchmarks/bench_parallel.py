"""Tensor parallelism on GPUs: decode latency and throughput at tensor 1 and tensor 2, side by side,
the NCCL all-reduce time inside each step, and whether tensor 2 generates what tensor 1 does (issue 7).

    source benchmarks/gpu_env.sh && R=$PWD && cd /tmp && python $R/benchmarks/bench_parallel.py \
        --model /tmp/ckpt8b --quantization rtn-w4 --workdir /tmp/tp --batch-sizes 1,32,128 --throughput-requests 1000 \
        --json $OUT/parallel.json

    python benchmarks/bench_parallel.py [--model checkpoints/ref-llama-12m] [--quantization none|rtn-w4|fp8]
        [--tensor 1,2] [--batch-sizes 1,8,32] [--prompt-tokens 128] [--output-tokens 128] [--dtype bfloat16]
        [--check-prompts 8] [--check-tokens 64] [--throughput-requests 0] [--workdir DIR] [--json out.json]

Needs as many GPUs as the largest tensor size (run with benchmarks/gpu_env.sh's environment). For
each tensor size the checkpoint is built (`--dtype`; `--quantization rtn-w4`: RTN 4-bit, group 128,
symmetric, no calibration; target cuda) into --workdir (reused when already built there; default a
temporary directory) and loaded with `LLM`; rank 0 drives, the other ranks are processes on GPUs
1, 2, ..., started with NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (runtime/parallel).

Agreement: --check-prompts prompts of --prompt-tokens random token ids, --check-tokens greedy tokens
each; every tensor size's outputs against tensor 1's: how many are identical, and the mean length of
the common prefix (bf16 sums in another order can flip a near-tie, after which outputs diverge).

Reported per tensor size and batch size B (B prompts of `--prompt-tokens` random token ids, each
generating exactly `--output-tokens` tokens, greedy, eos ignored; the engine as served: overlapped
scheduling, CUDA graphs on every rank, no timing hook):
  prefill_ms       wall time of generate(max_tokens=1): the prompts' prefill
  decode_ms/token  (wall(max_tokens=N) - wall(max_tokens=1)) / (N - 1): one decode step of the batch
  tokens/s         B × N / wall(max_tokens=N): generation throughput
  allreduce_ms     time per decode step rank 0 spends in all-reduces, from torch.profiler over 16 decode
                   steps of a separate run: the NCCL kernels' device time (inside graph replays too; it
                   includes waiting for the slower rank), on a CPU gloo's calls; and their number per step
  allreduce_share  allreduce_ms / decode_ms
Then tensor 2 / tensor 1 ratios of decode latency and throughput (issue 19's goals: batch-1 decode
<= 0.65x, throughput 128/128 >= 1.6x), and with --throughput-requests N the output tokens/s of N
requests of --prompt-tokens/--output-tokens submitted at once (bench_e2e.py's --throughput, in process).

A small model (the default ref-llama-12m) measures overheads: communication dominates, tensor 2 is
expected to be slower. Use a 7B+ checkpoint (--model) to see tensor parallelism pay off.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
QUANTIZATIONS = {
    "none": {"method": "none"},
    "rtn-w4": {"method": "rtn", "bits": 4, "group_size": 128, "symmetric": True},
    "fp8": {"method": "fp8"},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REPO_ROOT / "checkpoints" / "ref-llama-12m"), help="HF checkpoint directory")
    parser.add_argument("--tensor", default="1,2", help="tensor sizes to compare, comma-separated")
    parser.add_argument("--batch-sizes", default="1,8,32", help="concurrent sequences, comma-separated")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--quantization", default="none", choices=sorted(QUANTIZATIONS))
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per point (the best is kept)")
    parser.add_argument("--check-prompts", type=int, default=8, help="prompts compared against tensor 1 (0: none)")
    parser.add_argument("--check-tokens", type=int, default=64, help="greedy tokens per compared prompt")
    parser.add_argument("--throughput-requests", type=int, default=0,
                        help="also the throughput of this many requests of --prompt-tokens/--output-tokens (0: none)")
    parser.add_argument("--workdir", default=None, help="build the artifacts here and keep them (reused if present)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: gloo ranks, to test this script")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for the whole run: tensor size k of n skips batch sizes after k/n of it")
    return parser.parse_args(argv)


def build_artifact(args: argparse.Namespace, tensor: int, max_model_len: int, directory: Path) -> tuple[Path, float | None]:
    """(artifact, build seconds); an artifact already in `directory` is reused (None seconds)."""
    from llmc.compiler.build import build
    from llmc.compiler.recipe import recipe_from_dict

    out = directory / f"tensor{tensor}-{args.quantization}"
    if (out / "manifest.json").is_file():
        return out, None
    recipe = {"model": args.model, "output": str(out), "dtype": args.dtype, "parallel": {"tensor": tensor},
              "quantization": QUANTIZATIONS[args.quantization], "target": {"device": args.device},
              "runtime": {"max_model_len": max_model_len, "max_num_seqs": 256, "max_num_batched_tokens": 8192}}
    result = build(recipe_from_dict(recipe), show_progress=False)
    return result.output, result.seconds


def greedy_outputs(llm, args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    from llmc.runtime.sampling_params import SamplingParams

    rng = random.Random(1234)
    prompts = [[rng.randrange(10, vocab_size) for _ in range(args.prompt_tokens)] for _ in range(args.check_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.check_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """How many outputs are identical, and the mean length of the common prefix."""
    prefix = [next((i for i, (s, t) in enumerate(zip(a, b)) if s != t), min(len(a), len(b))) for a, b in zip(reference, other)]
    return {"identical": sum(a == b for a, b in zip(reference, other)), "of": len(reference),
            "mean_common_prefix": round(sum(prefix) / max(1, len(prefix)), 2), "tokens": len(reference[0]) if reference else 0}


def allreduce_per_step(llm, batch_size: int, prompt_tokens: int, steps: int, vocab_size: int, is_cuda: bool) -> tuple[float, float]:
    """(ms per decode step rank 0 spends in tensor-parallel all-reduces, all-reduces per step), from
    torch.profiler over `steps` decode steps of batch_size sequences (after their prefill, which is not
    profiled): on a GPU the NCCL kernels' device time (inside CUDA graph replays too; a kernel also
    waits for the slower rank), on a CPU gloo's all-reduce calls. A run of its own: the timed runs
    carry no hook, and the profiled one is not timed."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from llmc.runtime.sampling_params import SamplingParams

    rng = random.Random(batch_size + 1)
    prompts = [[rng.randrange(10, vocab_size) for _ in range(prompt_tokens)] for _ in range(batch_size)]
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(None, params, prompt_token_ids=prompt)
    engine.step()  # the prefill (and, overlapped, nothing resolved yet)
    engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if is_cuda else [])
    execute, forwards = engine.runner.execute, []

    def counted(*args, **kwargs):  # the steps that run a forward (the last engine step only resolves)
        forwards.append(1)
        return execute(*args, **kwargs)

    engine.runner.execute = counted
    try:
        with profile(activities=activities) as prof:
            while engine.has_unfinished_requests():
                engine.step()
            if is_cuda:
                torch.cuda.synchronize()
    finally:
        del engine.runner.execute  # the class's method again
    total_us, calls = 0.0, 0
    for event in prof.key_averages():
        name = event.key.lower()
        if is_cuda and "nccl" in name and "allreduce" in name.replace("_", ""):
            total_us, calls = total_us + event.self_device_time_total, calls + event.count
        elif not is_cuda and "gloo" in name and "all_reduce" in name:
            total_us, calls = total_us + event.cpu_time_total, calls + event.count
    num_steps = max(1, len(forwards))
    return total_us / 1000 / num_steps, calls / num_steps


def measure(llm, batch_size: int, prompt_tokens: int, output_tokens: int, vocab_size: int, repeats: int,
            is_cuda: bool) -> dict:
    from llmc.runtime.sampling_params import SamplingParams

    rng = random.Random(batch_size)
    prompts = [[rng.randrange(10, vocab_size) for _ in range(prompt_tokens)] for _ in range(batch_size)]

    def run(max_tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - start

    run(4)  # warm-up: allocator, kernels, NCCL communicators
    prefill = min(run(1) for _ in range(repeats))
    full = min(run(output_tokens) for _ in range(repeats))
    decode_ms = 1000 * (full - prefill) / (output_tokens - 1)
    allreduce_ms, calls = allreduce_per_step(llm, batch_size, prompt_tokens, min(16, output_tokens), vocab_size, is_cuda)
    return {
        "batch_size": batch_size,
        "prefill_ms": round(1000 * prefill, 2),
        "decode_ms_per_token": round(decode_ms, 3),
        "tokens_per_s": round(batch_size * output_tokens / full, 1),
        "allreduce_ms_per_step": round(allreduce_ms, 3),
        "allreduces_per_step": round(calls, 1),
        "allreduce_share": round(allreduce_ms / decode_ms, 3) if decode_ms > 0 else 0.0,
    }


def throughput(llm, num_requests: int, prompt_tokens: int, output_tokens: int, vocab_size: int) -> dict:
    """num_requests requests of prompt_tokens random ids, each generating exactly output_tokens, all
    submitted at once: output tokens per second (bench_e2e.py's --throughput INxOUT:N, in process)."""
    from llmc.runtime.sampling_params import SamplingParams

    rng = random.Random(7)
    prompts = [[rng.randrange(10, vocab_size) for _ in range(prompt_tokens)] for _ in range(num_requests)]
    llm.generate(prompts[: min(8, num_requests)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=output_tokens, ignore_eos=True))
    elapsed = time.perf_counter() - start
    return {"requests": num_requests, "shape": f"{prompt_tokens}/{output_tokens}", "elapsed_s": round(elapsed, 2),
            "output_tokens_per_s": round(num_requests * output_tokens / elapsed, 1)}


def run_tensor_size(args: argparse.Namespace, tensor: int, directory: Path, deadline: float) -> tuple[list[dict], dict]:
    """(a row per batch size, {build_s, load_s, backend, outputs}) for one tensor size; batch sizes
    that would start after `deadline` (a perf_counter time) are skipped."""
    import torch

    from llmc.runtime.llm import LLM

    max_model_len = args.prompt_tokens + max(args.output_tokens, args.check_tokens) + 8
    log(f"tensor {tensor}: building")
    artifact, build_s = build_artifact(args, tensor, max_model_len, directory)
    log(f"tensor {tensor}: {'prebuilt' if build_s is None else f'built in {build_s:.1f} s'}, loading")
    results, start = [], time.perf_counter()
    # No prefix caching: the timed runs repeat their prompts, and prefill_ms must be a real prefill.
    with LLM(artifact, device=args.device, disable_log_stats=True, enable_prefix_caching=False) as llm:
        info = {"build_s": None if build_s is None else round(build_s, 1), "load_s": round(time.perf_counter() - start, 1),
                "backend": tp_backend_name(llm.engine.runner)}
        vocab_size = llm.engine.manifest.model.vocab_size
        info["outputs"] = greedy_outputs(llm, args, vocab_size) if args.check_prompts else []
        info["graphs"] = llm.engine.runner.graphs.batch_sizes if llm.engine.runner.graphs is not None else None
        info["overlap"] = llm.engine._can_overlap
        for batch_size in (int(b) for b in args.batch_sizes.split(",")):
            if time.perf_counter() > deadline:
                log(f"tensor {tensor}: out of time budget, batch size {batch_size} and later skipped")
                break
            row = {"tensor": tensor, **measure(llm, batch_size, args.prompt_tokens, args.output_tokens,
                                               vocab_size, args.repeats, args.device == "cuda")}
            log(json.dumps(row))
            results.append(row)
        if args.throughput_requests and time.perf_counter() < deadline:
            info["throughput"] = throughput(llm, args.throughput_requests, args.prompt_tokens, args.output_tokens,
                                            vocab_size)
            log(f"tensor {tensor}: throughput {json.dumps(info['throughput'])}")
    del llm
    gc.collect()  # the single-rank runner (and its KV cache, most of GPU 0) must go before the next size loads
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return results, info


def tp_backend_name(runner) -> str | None:
    """The tensor-parallel all-reduce's backend class (ProcessGroupNCCL on GPUs), None on one rank."""
    group = runner.shard.model.tp_group if hasattr(runner, "shard") else None
    return type(group.backend).__name__ if group is not None else None


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def print_table(rows: list[dict]) -> None:
    columns = ["tensor", "batch_size", "prefill_ms", "decode_ms_per_token", "tokens_per_s",
               "allreduce_ms_per_step", "allreduces_per_step", "allreduce_share"]
    print(" | ".join(columns))
    print(" | ".join("---" for _ in columns))
    for row in rows:
        print(" | ".join(str(row[c]) for c in columns))
    by_key = {(r["tensor"], r["batch_size"]): r for r in rows}
    tensors = sorted({r["tensor"] for r in rows})
    if 1 in tensors and len(tensors) > 1:
        print()
        print("tensor | batch_size | decode latency vs tensor 1 | throughput vs tensor 1")
        print("--- | --- | --- | ---")
        for (tensor, batch_size), row in sorted(by_key.items()):
            base = by_key.get((1, batch_size))
            if tensor != 1 and base is not None:
                goal = " (goal <= 0.65x)" if batch_size == 1 else ""
                print(f"{tensor} | {batch_size} | {row['decode_ms_per_token'] / base['decode_ms_per_token']:.2f}x{goal} | "
                      f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    tensors = [int(t) for t in args.tensor.split(",")]
    if args.device == "cuda" and (not torch.cuda.is_available() or torch.cuda.device_count() < max(tensors)):
        print(f"needs {max(tensors)} CUDA GPUs, found {torch.cuda.device_count() if torch.cuda.is_available() else 0}",
              file=sys.stderr)
        return 2
    rows, infos = [], {}
    env = {name: os.environ.get(name) for name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")}
    with tempfile.TemporaryDirectory(prefix="bench-parallel-") as tmp:
        directory = Path(args.workdir) if args.workdir else Path(tmp)
        directory.mkdir(parents=True, exist_ok=True)
        begin = time.perf_counter()
        for k, tensor in enumerate(tensors):
            deadline = float("inf") if args.budget is None else begin + args.budget * (k + 1) / len(tensors)
            tensor_rows, infos[tensor] = run_tensor_size(args, tensor, directory, deadline)
            rows.extend(tensor_rows)
            write_json(args, rows, infos, env)  # after every size: a run cut short keeps what it measured
    print_table(rows)
    for tensor, info in infos.items():
        built = "prebuilt" if info["build_s"] is None else f"built in {info['build_s']} s"
        print(f"tensor {tensor}: {built}, loaded in {info['load_s']} s, all-reduce backend {info['backend']}, "
              f"CUDA graphs {info['graphs']}, overlapped {info['overlap']}, outputs vs tensor 1: {info.get('agreement')}, "
              f"throughput {info.get('throughput')}")
    base = infos.get(1, {}).get("throughput")
    for tensor, info in infos.items():
        if tensor != 1 and base and info.get("throughput"):
            ratio = info["throughput"]["output_tokens_per_s"] / base["output_tokens_per_s"]
            print(f"throughput tensor {tensor} / tensor 1: {ratio:.2f}x (goal >= 1.6x)")
    write_json(args, rows, infos, env)
    return 0


def write_json(args: argparse.Namespace, rows: list[dict], infos: dict, env: dict) -> None:
    reference = infos.get(1, {}).get("outputs")
    for info in infos.values():
        if reference and info["outputs"]:
            info["agreement"] = agreement(reference, info["outputs"])
    if args.json:
        summary = {t: {k: v for k, v in info.items() if k != "outputs"} for t, info in infos.items()}
        Path(args.json).write_text(json.dumps({"args": vars(args), "env": env, "tensor_sizes": summary,
                                               "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
