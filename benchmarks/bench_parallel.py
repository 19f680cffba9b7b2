"""Tensor parallelism on GPUs: decode latency and throughput at tensor 1 and tensor 2, side by side,
and the NCCL all-reduce time inside each step.

    python benchmarks/bench_parallel.py [--model checkpoints/ref-llama-12m] [--tensor 1,2]
        [--batch-sizes 1,8,32] [--prompt-tokens 128] [--output-tokens 128] [--dtype bfloat16] [--json out.json]

Needs as many GPUs as the largest tensor size (run with benchmarks/gpu_env.sh's environment). For
each tensor size the checkpoint is built (unquantized, `--dtype`) into a temporary directory and
loaded with `LLM`; rank 0 drives, the other ranks are processes on GPUs 1, 2, ...

Reported per tensor size and batch size B (B prompts of `--prompt-tokens` random token ids, each
generating exactly `--output-tokens` tokens, greedy, eos ignored):
  prefill_ms       wall time of generate(max_tokens=1): the prompts' prefill
  decode_ms/token  (wall(max_tokens=N) - wall(max_tokens=1)) / (N - 1): one decode step of the batch
  tokens/s         B × N / wall(max_tokens=N): generation throughput
  allreduce_ms     mean time per decode step rank 0 spends in all-reduces (CUDA events around each
                   call, so it includes waiting for the slower rank), and their number per step
  allreduce_share  allreduce_ms / the mean decode step time on rank 0
Then tensor 2 / tensor 1 ratios of decode latency and throughput.

A small model (the default ref-llama-12m) measures overheads: communication dominates, tensor 2 is
expected to be slower. Use a 7B+ checkpoint (--model) to see tensor parallelism pay off.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REPO_ROOT / "checkpoints" / "ref-llama-12m"), help="HF checkpoint directory")
    parser.add_argument("--tensor", default="1,2", help="tensor sizes to compare, comma-separated")
    parser.add_argument("--batch-sizes", default="1,8,32", help="concurrent sequences, comma-separated")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per point (the best is kept)")
    parser.add_argument("--json", default=None, help="also write the results here")
    return parser.parse_args(argv)


def build_artifact(model: str, tensor: int, dtype: str, max_model_len: int, directory: Path) -> Path:
    from llmc.compiler.build import build
    from llmc.compiler.recipe import recipe_from_dict

    out = directory / f"tensor{tensor}"
    recipe = {"model": model, "output": str(out), "dtype": dtype, "parallel": {"tensor": tensor},
              "runtime": {"max_model_len": max_model_len, "max_num_seqs": 256, "max_num_batched_tokens": 8192}}
    return build(recipe_from_dict(recipe), show_progress=False).output


class AllReduceTimer:
    """Wraps rank 0's tensor-parallel all-reduce: CUDA events around each call, summed per step."""

    def __init__(self, runner):
        import torch

        self.torch = torch
        self.events: list[tuple] = []
        self.step_times: list[float] = []
        model = runner.shard.model if hasattr(runner, "shard") else runner.model  # parallel driver | one rank
        group = model.tp_group
        if group is not None:
            inner = group.all_reduce

            def timed(tensor):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = inner(tensor)
                end.record()
                self.events.append((start, end))
                return out

            group.all_reduce = timed  # the model's layers call the group object: this instance attribute wins
        forward = runner.forward_logits

        def timed_forward(input_ids, batch):
            torch.cuda.synchronize()
            begin = time.perf_counter()
            logits = forward(input_ids, batch)
            torch.cuda.synchronize()
            self.step_times.append(time.perf_counter() - begin)
            return logits

        runner.forward_logits = timed_forward

    def reset(self) -> None:
        self.events.clear()
        self.step_times.clear()

    def per_step(self) -> tuple[float, float, float]:
        """(all-reduce ms per step, all-reduce calls per step, step ms), over the steps since reset."""
        self.torch.cuda.synchronize()
        num_steps = max(1, len(self.step_times))
        total_ms = sum(start.elapsed_time(end) for start, end in self.events)
        return total_ms / num_steps, len(self.events) / num_steps, 1000 * sum(self.step_times) / num_steps


def measure(llm, timer: AllReduceTimer, batch_size: int, prompt_tokens: int, output_tokens: int,
            vocab_size: int, repeats: int) -> dict:
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
    timer.reset()
    full = min(run(output_tokens) for _ in range(repeats))
    allreduce_ms, calls, step_ms = timer.per_step()
    decode_ms = 1000 * (full - prefill) / (output_tokens - 1)
    return {
        "batch_size": batch_size,
        "prefill_ms": round(1000 * prefill, 2),
        "decode_ms_per_token": round(decode_ms, 3),
        "tokens_per_s": round(batch_size * output_tokens / full, 1),
        "allreduce_ms_per_step": round(allreduce_ms, 3),
        "allreduces_per_step": round(calls, 1),
        "allreduce_share": round(allreduce_ms / step_ms, 3) if step_ms else 0.0,
    }


def run_tensor_size(args: argparse.Namespace, tensor: int, directory: Path) -> list[dict]:
    from llmc.runtime.llm import LLM

    max_model_len = args.prompt_tokens + args.output_tokens + 8
    artifact = build_artifact(args.model, tensor, args.dtype, max_model_len, directory)
    results = []
    with LLM(artifact, device="cuda", disable_log_stats=True) as llm:
        timer = AllReduceTimer(llm.engine.runner)
        vocab_size = llm.engine.manifest.model.vocab_size
        for batch_size in (int(b) for b in args.batch_sizes.split(",")):
            row = {"tensor": tensor, **measure(llm, timer, batch_size, args.prompt_tokens, args.output_tokens,
                                               vocab_size, args.repeats)}
            print(json.dumps(row), file=sys.stderr, flush=True)
            results.append(row)
    return results


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
                print(f"{tensor} | {batch_size} | {row['decode_ms_per_token'] / base['decode_ms_per_token']:.2f}x | "
                      f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    tensors = [int(t) for t in args.tensor.split(",")]
    if not torch.cuda.is_available() or torch.cuda.device_count() < max(tensors):
        print(f"needs {max(tensors)} CUDA GPUs, found {torch.cuda.device_count() if torch.cuda.is_available() else 0}",
              file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-parallel-") as tmp:
        for tensor in tensors:
            rows.extend(run_tensor_size(args, tensor, Path(tmp)))
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
