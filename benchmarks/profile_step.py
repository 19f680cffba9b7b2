"""Where a decode step's time goes: engine wall time, model forward / GPU kernel time, phase split.

    python benchmarks/profile_step.py ARTIFACT [--device cuda|cpu] [--batch-sizes 1,64,256]
        [--steps 30] [--prompt-len 128] [--sync] [--json OUT.json] [--top-kernels N] [--kernel-trace TRACE.json]

For each batch size B: B requests of --prompt-len random token ids (greedy, ignore_eos) are added to
an Engine and stepped until all of them decode; then --steps decode steps are measured twice:

  1. plain (no profiler): the engine's wall time per step (`Engine.step()`), and the host time of
     each phase: schedule, launch (runner.execute: build inputs + forward; then the sampler), advance
     (the scheduler's pending-token update), resolve (waiting for the previous step's tokens,
     detokenizing, stops, outputs). On a CPU the forward is synchronous, so `forward_ms` (the time
     inside runner.forward_logits) is the model's own time and `wall_over_forward` the engine's
     overhead ratio.
  2. on CUDA, under torch.profiler: the GPU kernel time per step (`kernel_ms`: the time during which
     some CUDA kernel ran, the union of their intervals; `kernel_sum_ms`: their summed durations,
     which count twice the time a kernel launched with programmatic dependent launch waits beside
     the one before it), and `gpu_busy` = kernel_ms / plain wall time, and `host_not_hidden_ms` =
     plain wall − kernel_ms: the time per step the GPU waits for the host.

--sync measures the synchronous engine (async_scheduling false) for comparison. Prints one JSON line
per batch size and writes all of them to --json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from llmc.runtime.engine import Engine
from llmc.runtime.sampling_params import SamplingParams

PHASES = {"schedule": ("scheduler", "schedule"), "execute": ("runner", "execute"), "sample": ("sampler", "sample"),
          "advance": ("scheduler", "advance"), "resolve": (None, "_resolve")}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--sync", action="store_true", help="async_scheduling false")
    parser.add_argument("--torch-state-layers", action="store_true",
                        help="a hybrid model's conv, delta rule and SSD on their torch ops (the CPU's path) instead of "
                             "their Triton kernels (kernels/recurrent.py), for a same-run baseline")
    parser.add_argument("--mamba-ssm-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="a hybrid model's recurrent state dtype (the engine option of that name)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--top-kernels", type=int, default=0, help="also list the N longest CUDA kernels per step")
    parser.add_argument("--kernel-trace", type=Path, default=None,
                        help="write every CUDA kernel of the profiled steps, in start order, to this JSON "
                             "(per batch size: [name, start µs, duration µs]); under LLMC_PDL=1 a kernel's "
                             "duration includes its wait for the kernel before it")
    return parser.parse_args(argv)


class PhaseTimer:
    """Wraps methods of the engine's parts with perf_counter accumulators (host time, no sync)."""

    def __init__(self, engine: Engine):
        self.totals = dict.fromkeys([*PHASES, "forward"], 0.0)
        self._wrapped: list[tuple[object, str]] = []
        for phase, (owner, name) in PHASES.items():
            self._wrap(engine if owner is None else getattr(engine, owner), name, phase)
        self._wrap(engine.runner, "forward_logits", "forward")

    def _wrap(self, obj, name: str, phase: str) -> None:
        original = getattr(obj, name)
        self._wrapped.append((obj, name))

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.totals[phase] += time.perf_counter() - start

        setattr(obj, name, timed)

    def reset(self) -> None:
        self.totals = dict.fromkeys(self.totals, 0.0)

    def close(self) -> None:
        """Back to the classes' methods."""
        for obj, name in self._wrapped:
            vars(obj).pop(name, None)


def fill(engine: Engine, batch_size: int, args, rng: random.Random) -> None:
    """batch_size decoding requests, each with room for far more tokens than the measurement takes."""
    vocab = engine.manifest.model.vocab_size
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.max_model_len - args.prompt_len - 1)
    for _ in range(batch_size):
        engine.add_request(None, params, prompt_token_ids=[rng.randrange(vocab) for _ in range(args.prompt_len)])
    while engine.scheduler.num_waiting or any(r.num_output_tokens < 2 for r in engine.scheduler.running):
        engine.step()
    for _ in range(3):  # steady state: nothing but decodes in flight
        engine.step()


def measure(engine: Engine, timer: PhaseTimer, steps: int) -> dict:
    timer.reset()
    walls = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
    ms = lambda seconds: round(1000 * seconds / steps, 3)  # noqa: E731
    return {"wall_ms": ms(sum(walls)), "wall_median_ms": round(1000 * statistics.median(walls), 3),
            **{f"{phase}_ms": ms(total) for phase, total in timer.totals.items()}}


def kernel_events(prof) -> list:
    """A torch.profiler run's CUDA kernel events in start order."""
    return sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)


def busy_us(events) -> float:
    """The time some kernel ran, µs: the length of the union of the events' intervals (in start order).
    Kernels launched with programmatic dependent launch start before the kernel they depend on ends
    and wait on the device, so their durations overlap and a plain sum counts that time twice."""
    total, end = 0.0, float("-inf")
    for event in events:
        start, stop = event.time_range.start, event.time_range.end
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def kernel_time_per_step(engine: Engine, steps: int, top: int) -> tuple[float, float, list[dict], list]:
    """(ms per step during which some CUDA kernel ran, the kernels' summed durations per step, the `top`
    kernels by time: name, µs and calls per step, every kernel as [name, start µs from the first,
    duration µs] in start order)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    listed = [{"kernel": e.key[:120], "us": round(e.self_device_time_total / steps, 1),
               "calls": round(e.count / steps, 2)} for e in kernels[:top]]
    events = kernel_events(prof)
    t0 = events[0].time_range.start if events else 0
    trace = [[e.name[:100], round(e.time_range.start - t0, 2), round(e.time_range.elapsed_us(), 2)] for e in events]
    return busy_us(events) / 1000 / steps, sum(e.self_device_time_total for e in kernels) / 1000 / steps, listed, trace


def profile_batch(engine: Engine, timer: PhaseTimer, batch_size: int, args, rng, traces: dict) -> dict:
    fill(engine, batch_size, args, rng)
    result = {"batch_size": batch_size, "running": engine.scheduler.num_running,
              "async_scheduling": engine.options.async_scheduling,
              "mamba_ssm_cache_dtype": engine.options.mamba_ssm_cache_dtype, **measure(engine, timer, args.steps)}
    if engine.device.type == "cuda":
        kernel_ms, kernel_sum_ms, top, traces[batch_size] = kernel_time_per_step(engine, args.steps, args.top_kernels)
        result.update(kernel_ms=round(kernel_ms, 3), kernel_sum_ms=round(kernel_sum_ms, 3),
                      gpu_busy=round(kernel_ms / result["wall_ms"], 3),
                      host_not_hidden_ms=round(result["wall_ms"] - kernel_ms, 3))
        if top:
            result["top_kernels"] = top
    else:
        result["wall_over_forward"] = round(result["wall_ms"] / result["forward_ms"], 3)
    for request_id in list(engine.groups):
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.torch_state_layers:
        from llmc.kernels import recurrent

        recurrent.can_use_triton = lambda *tensors: False
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    options = {"max_num_seqs": max(batch_sizes), "max_model_len": args.max_model_len, "disable_log_stats": True,
               "async_scheduling": not args.sync, "max_num_batched_tokens": max(8192, args.prompt_len)}
    if args.mamba_ssm_cache_dtype != "auto":
        options["mamba_ssm_cache_dtype"] = args.mamba_ssm_cache_dtype
    if args.num_kv_blocks is not None:
        options["num_kv_blocks"] = args.num_kv_blocks
    engine = Engine(args.artifact, device=args.device, **options)
    timer = PhaseTimer(engine)
    rng = random.Random(0)
    fill(engine, 4, args, rng)  # warm-up (kernels compile, the allocator fills)
    for request_id in list(engine.groups):
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    device = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu"
    results, traces = [], {}
    for batch_size in batch_sizes:
        result = {"artifact": str(args.artifact), "device": device,
                  **profile_batch(engine, timer, batch_size, args, rng, traces)}
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    if args.kernel_trace is not None:
        args.kernel_trace.write_text(json.dumps({"device": device, "steps": args.steps, "kernels": traces}) + "\n")
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
