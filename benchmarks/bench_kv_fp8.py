"""FP8 KV cache and CPU weight offload on one GPU: what fits, and what decode costs.

    source benchmarks/gpu_env.sh && python benchmarks/bench_kv_fp8.py --work /tmp/kvfp8 --json /tmp/kvfp8.json

Makes (once) an 8B-shaped random bf16 checkpoint with benchmarks/make_checkpoint.py and a bf16
artifact of it, then measures, each in a fresh engine:
  1. KV tokens that fit (the runtime's measured memory plan) with kv_cache_dtype auto (bf16) vs fp8;
  2. decode latency per step at --batch sequences of --context tokens, bf16 KV vs fp8 KV: one
     generate of 1 token (prefill only) and one of 1 + --steps tokens, prefix caching off, so the
     difference over --steps is the decode time alone;
  3. decode with cpu_offload_gb in --offload (default 4 and 8) at a small batch and context, with
     tokens/s set against the host-to-device bandwidth measured here (pinned → device copy of 1 GiB):
     the bound is (offloaded bytes / bandwidth) per step.
Sized to finish in under 8 minutes on an H100 (engine starts dominate). `--tiny` (with --device cpu)
runs the same steps on a 2-layer checkpoint on a CPU to check the script; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

from llmc import LLM, SamplingParams
from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict


def host_to_device_gbps(device: torch.device, num_bytes: int = 1 << 30) -> float | None:
    if device.type != "cuda":
        return None
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    dest = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dest.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(3):
        dest.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    return 3 * num_bytes / (time.perf_counter() - start) / 1e9


def make_artifact(work: Path, tiny: bool, max_model_len: int) -> Path:
    checkpoint, artifact = work / ("ckpt-tiny" if tiny else "ckpt-8b"), work / ("art-tiny" if tiny else "art-8b")
    if not (checkpoint / "config.json").is_file():
        spec = importlib.util.spec_from_file_location("make_checkpoint", Path(__file__).with_name("make_checkpoint.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.make_checkpoint(checkpoint, tiny=tiny)
    if not (artifact / "manifest.json").is_file():
        build(recipe_from_dict({"model": str(checkpoint), "output": str(artifact),
                                "runtime": {"max_model_len": max_model_len}}), show_progress=False)
    return artifact


def decode_run(artifact: Path, device: str, batch: int, context: int, steps: int, **options) -> dict:
    """KV capacity, and seconds per decode step of `batch` sequences of `context` tokens."""
    llm = LLM(str(artifact), device=device, max_num_seqs=batch, max_model_len=context + steps + 8,
              enable_prefix_caching=False, **options)
    runner = llm.engine.runner
    result = {**options, "num_kv_tokens": runner.num_blocks * llm.engine.options.block_size,
              "kv_dtype": str(runner.kv_config.dtype).removeprefix("torch.")}
    if runner.offloader is not None:
        result |= {"offloaded_layers": len(runner.offloader.plan.layers),
                   "offloaded_bytes": runner.offloader.plan.offloaded_bytes}
    prompts = [{"prompt_token_ids": [(7 * i + 13 * t) % 1000 + 10 for t in range(context)]} for i in range(batch)]
    timings = []
    for max_tokens in (1, 1 + steps):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params)
        timings.append(time.perf_counter() - start)
    step = max(timings[1] - timings[0], 1e-9) / steps
    result |= {"batch": batch, "context": context, "decode_steps": steps, "prefill_seconds": timings[0],
               "decode_step_ms": step * 1e3, "decode_tokens_per_s": batch / step}
    del llm, runner
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_kv_fp8"), help="checkpoint and artifact directory")
    parser.add_argument("--json", type=Path, required=True, help="write the results here")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer checkpoint (CPU dry run)")
    parser.add_argument("--device", default=None, help="cuda or cpu [default: cuda when available]")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed")
    parser.add_argument("--offload", type=float, nargs="*", default=[4.0, 8.0], help="cpu_offload_gb values")
    parser.add_argument("--offload-batch", type=int, default=8)
    parser.add_argument("--offload-context", type=int, default=512)
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.work.mkdir(parents=True, exist_ok=True)
    artifact = make_artifact(args.work, args.tiny, args.context + args.steps + 8)
    results = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu", "artifact": str(artifact),
               "host_to_device_GBps": host_to_device_gbps(torch.device(device))}
    cpu = {"cpu_kv_cache_gib": 0.25} if device == "cpu" else {}
    runs = {kv: decode_run(artifact, device, args.batch, args.context, args.steps, kv_cache_dtype=kv, **cpu)
            for kv in ("auto", "fp8")}
    results["kv"] = runs
    results["kv_tokens_ratio_fp8_over_auto"] = runs["fp8"]["num_kv_tokens"] / max(runs["auto"]["num_kv_tokens"], 1)
    results["decode_step_ratio_fp8_over_auto"] = runs["fp8"]["decode_step_ms"] / runs["auto"]["decode_step_ms"]
    results["offload"] = []
    for gib in args.offload:
        run = decode_run(artifact, device, args.offload_batch, args.offload_context, max(4, args.steps // 4),
                         cpu_offload_gb=gib, **cpu)
        if results["host_to_device_GBps"] and run.get("offloaded_bytes"):
            bound = run["offloaded_bytes"] / (results["host_to_device_GBps"] * 1e9)  # seconds per step, copies alone
            run |= {"copy_bound_step_ms": bound * 1e3,
                    "copy_bound_tokens_per_s": args.offload_batch / bound,
                    "fraction_of_copy_bound": (bound * 1e3) / run["decode_step_ms"]}
        results["offload"].append(run)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    sys.exit(main() and 0)
