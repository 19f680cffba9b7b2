"""Where a throughput run's time goes: step by step, and kernel by kernel (issue 12).

    source benchmarks/gpu_env.sh && R=$PWD && cd /tmp && python $R/benchmarks/profile_throughput.py \\
        /tmp/bf16=bf16 /tmp/fp8=fp8@max_num_seqs=512 [--throughput 128x128:1000] [--kernels] --json OUT.json

The workload is bench_e2e.py's throughput part (the same prompts, warm-up and engine options: N requests
of IN random token ids, OUT tokens each, all submitted at once). Every launched step is recorded: its
decode rows and prompt tokens, the time the `Engine.step()` call that launched it returned, and on CUDA
two events, before and after its launch (forward, sampling, the copy of its tokens). With overlapped
scheduling call k launches step k and returns once step k-1's tokens are on the host, so the time from
call k's return to call k+1's is step k's share of the wall time; the synchronous engine's call k is
step k itself. The events give the GPU's time per step (first event to last: kernels, and any wait for
launches in between) and its idle time before each step (the previous step's last event to this
step's first: time the GPU waited for the host). Steps are grouped as "decode" (only decodes; also
by batch size, in bands of 32) and "mixed" (any prompt tokens). Also: the host time per engine phase
(profile_step.py's timers), Python's garbage-collection time, the CUDA graph replays and the Triton
kernels compiled during the run.

--kernels runs the workload a second time (new prompts, so the prefix cache does not hold them) under
torch.profiler (CUDA kernels only) and adds the kernel time of the whole run (summed, and the time some
kernel ran: kernels launched with programmatic dependent launch overlap the one before), the GPU-busy fraction
(busy time / elapsed; the profiler slows the host) and the --top kernels by time. --clocks samples the SM
clock, power draw and clock-event reasons with `nvidia-smi -lms 100` during the (first) run and reports the
samples under load: a bf16 run on an H100 is held at its 700 W cap (session 28: SM clock median 1,575 of
1,980 MHz).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import log, parse_engine_options, parse_throughput, random_prompts, run_requests, warm_up  # noqa: E402
from profile_step import PhaseTimer, busy_us, kernel_events  # noqa: E402

from llmc.runtime.batch_sampler import HostTokens  # noqa: E402
from llmc.runtime.llm import LLM  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", nargs="+", help="ARTIFACT_DIR[=LABEL[@KEY=VALUE,...]]")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--throughput", default="128x128:1000", help="INPUTxOUTPUT:NUM_REQUESTS (one)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--output-kind", default="final_only", choices=["final_only", "delta", "cumulative"],
                        help="the requests' output_kind (bench_e2e.py's --output-kind)")
    parser.add_argument("--kernels", action="store_true", help="a second run under torch.profiler")
    parser.add_argument("--clocks", action="store_true",
                        help="sample the SM clock and power draw (nvidia-smi) during the run: is it held at the power cap?")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--tail", type=int, default=0,
                        help="also list the last N launched steps one by one (rows, GPU and idle ms, host ms by phase)")
    parser.add_argument("--json", type=Path, default=Path("profile_throughput.json"))
    return parser.parse_args(argv)


class StepRecorder:
    """Wraps engine._launch and engine.step: per launched step its decode rows and prompt tokens, the
    time the step() call that launched it returned, and on CUDA two events around its launch."""

    def __init__(self, engine, phase_totals: dict[str, float] | None = None):
        self.steps: list[tuple[int, int]] = []
        self.ends: list[float] = []  # one per step() call that launched a step
        # per such call: the outputs it returned and a snapshot of `phase_totals` (PhaseTimer's) at its return
        self.returns: list[tuple[int, dict[str, float]]] = []
        self.events: list[tuple] = []
        launch, step = engine._launch, engine.step
        is_cuda = engine.device.type == "cuda"

        def recorded_launch(batch):
            self.steps.append((batch.num_decodes, batch.num_batched_tokens - batch.num_decodes))
            if is_cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                result = launch(batch)
                end.record()
                self.events.append((begin, end))
                return result
            return launch(batch)

        def recorded_step():
            num_steps = len(self.steps)
            outputs = step()
            if len(self.steps) > num_steps:
                self.ends.append(time.perf_counter())
                self.returns.append((len(outputs), dict(phase_totals or {})))
            return outputs

        engine._launch, engine.step = recorded_launch, recorded_step
        self._engine = engine

    def close(self) -> None:
        """Back to the engine's own methods."""
        vars(self._engine).pop("_launch")
        vars(self._engine).pop("step")

    def gpu_times(self) -> list[tuple[float, float]]:
        """(seconds the GPU spent from the step's first event to its last, idle seconds before it); zeros
        off CUDA."""
        if not self.events:
            return [(0.0, 0.0)] * len(self.steps)
        torch.cuda.synchronize()
        times, previous = [], None
        for begin, end in self.events:
            gap = 0.0 if previous is None else previous.elapsed_time(begin) / 1000
            times.append((begin.elapsed_time(end) / 1000, gap))
            previous = end
        return times


class GcTimer:
    """Time spent in Python's garbage collector, per generation (gc.callbacks)."""

    def __init__(self):
        self.seconds, self.count, self._start = [0.0, 0.0, 0.0], [0, 0, 0], 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._start
            self.count[info["generation"]] += 1

    def close(self) -> dict:
        gc.callbacks.remove(self._callback)
        return {"gc_s_by_generation": [round(x, 3) for x in self.seconds], "gc_count_by_generation": self.count}


class ClockSampler:
    """The GPU's SM clock, power draw and clock-event reasons, sampled by `nvidia-smi -lms` every
    `period_ms` while it is open (`--clocks`): whether a run is held at the power cap."""

    QUERY = "clocks.sm,clocks.max.sm,power.draw,power.limit,clocks_event_reasons.active"
    SW_POWER_CAP = 0x4  # nvidia-smi's clocks_event_reasons bits
    HW_SLOWDOWN = 0x8 | 0x20 | 0x40 | 0x80  # hardware slowdown, software thermal, hardware thermal, power brake

    def __init__(self, device_index: int, period_ms: int = 100):
        import subprocess

        self.process = subprocess.Popen(
            ["nvidia-smi", f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits", "-lms", str(period_ms),
             "-i", str(device_index)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    def close(self) -> dict:
        self.process.terminate()
        lines = self.process.communicate()[0].splitlines()
        return {"clocks": summarize_clocks(lines)}


def summarize_clocks(lines: list[str]) -> dict:
    """ClockSampler's CSV lines → the samples under load (drawing over half the power limit): SM clock
    min / median / max against the maximum, median power, and how many had the software power cap or a
    hardware slowdown active."""
    samples = []
    for line in lines:
        fields = [f.strip() for f in line.split(",")]
        try:
            samples.append((float(fields[0]), float(fields[1]), float(fields[2]), float(fields[3]), int(fields[4], 16)))
        except (ValueError, IndexError):  # "[N/A]" or a cut line
            continue
    load = sorted((s for s in samples if s[2] > 0.5 * s[3]), key=lambda s: s[0])
    out = {"samples": len(samples), "under_load": len(load)}
    if load:
        out.update({
            "sm_mhz_min": load[0][0], "sm_mhz_median": load[len(load) // 2][0], "sm_mhz_max": load[-1][0],
            "sm_mhz_limit": load[0][1], "power_w_median": sorted(s[2] for s in load)[len(load) // 2],
            "power_w_limit": load[0][3],
            "power_capped": sum(1 for s in load if s[4] & ClockSampler.SW_POWER_CAP),
            "hw_slowdown": sum(1 for s in load if s[4] & ClockSampler.HW_SLOWDOWN),
        })
    return out


class CompileRecorder:
    """Triton kernels compiled (or loaded from the disk cache) while it is open: name and seconds."""

    def __init__(self):
        try:
            from triton import knobs
        except ImportError:  # no triton: nothing compiles
            self.knobs, self.compiles = None, []
            return
        self.knobs, self.compiles, self._start = knobs, [], 0.0
        knobs.runtime.jit_cache_hook = self._before
        knobs.runtime.jit_post_compile_hook = self._after

    def _before(self, **kwargs) -> bool:
        self._start = time.perf_counter()
        return False  # compile it

    def _after(self, fn, **kwargs) -> bool:
        self.compiles.append((fn.name, time.perf_counter() - self._start))
        return False

    def close(self) -> dict:
        if self.knobs is not None:
            self.knobs.runtime.jit_cache_hook = self.knobs.runtime.jit_post_compile_hook = None
        return {"triton_compiles": len(self.compiles), "triton_compile_s": round(sum(s for _, s in self.compiles), 3),
                "triton_compiled": sorted({name for name, _ in self.compiles})}


def step_summary(recorder: StepRecorder, gpu: list[tuple[float, float]], start: float, is_async: bool) -> dict:
    """Per-step time grouped by kind and decode batch size: host time between step() returns (see the
    module docstring) and, on CUDA, the GPU's time per step and its idle time before each step."""
    ends = [start] + recorder.ends
    keys = ("steps", "seconds", "gpu_s", "gpu_idle_s", "decode_rows", "prompt_tokens")
    groups: dict[str, dict] = defaultdict(lambda: dict.fromkeys(keys, 0))
    for k, ((decodes, prompt), (gpu_s, idle_s)) in enumerate(zip(recorder.steps, gpu)):
        # async: step k's time is from call k's return to call k+1's; sync: call k itself
        begin, end = (ends[k + 1], ends[k + 2]) if is_async and k + 2 < len(ends) else (ends[k], ends[k + 1])
        kind = f"decode<={32 * ((decodes - 1) // 32 + 1)}"
        for name in ("mixed",) if prompt else ("decode", kind):
            g = groups[name]
            for key, value in zip(keys, (1, end - begin, gpu_s, idle_s, decodes, prompt)):
                g[key] += value
    out = {}
    for name, g in sorted(groups.items()):
        n = g["steps"]
        out[name] = {"steps": n, "seconds": round(g["seconds"], 3), "ms_per_step": round(1000 * g["seconds"] / n, 2),
                     "gpu_ms_per_step": round(1000 * g["gpu_s"] / n, 2),
                     "gpu_idle_ms_per_step": round(1000 * g["gpu_idle_s"] / n, 2),
                     "mean_decode_rows": round(g["decode_rows"] / n, 1),
                     "mean_prompt_tokens": round(g["prompt_tokens"] / n, 1)}
    return out


def tail_steps(recorder: StepRecorder, gpu: list[tuple[float, float]], start: float, count: int) -> list[dict]:
    """The last `count` launched steps one by one. Call k launches step k and (async) resolves step k-1:
    host_ms is the time from call k-1's return to call k's, phases_ms what call k spent in each phase,
    outputs what it returned (final-only outputs: the requests that finished)."""
    ends = [start] + recorder.ends
    rows, previous = [], {}
    for k, ((decodes, prompt), (gpu_s, idle_s), (outputs, totals)) in enumerate(zip(recorder.steps, gpu, recorder.returns)):
        if k >= len(recorder.steps) - count:
            rows.append({"step": k, "decode_rows": decodes, "prompt_tokens": prompt, "gpu_ms": round(1000 * gpu_s, 2),
                         "gpu_idle_ms": round(1000 * idle_s, 2), "host_ms": round(1000 * (ends[k + 1] - ends[k]), 2),
                         "outputs": outputs,
                         "phases_ms": {p: round(1000 * (t - previous.get(p, 0.0)), 2) for p, t in totals.items()}})
        previous = totals
    return rows


def run_once(engine, prompts, out_tokens: int, output_kind: str, tail: int = 0, clocks: bool = False,
             ) -> tuple[dict, float, int]:
    timer, gc_timer, compiles = PhaseTimer(engine), GcTimer(), CompileRecorder()
    sampler = ClockSampler(engine.device.index or 0) if clocks and engine.device.type == "cuda" else None
    recorder = StepRecorder(engine, timer.totals)
    wait = HostTokens.wait
    timer.totals["wait"] = 0.0  # of resolve: blocked until the step's tokens are on the host

    def timed_wait(host_tokens):
        begin = time.perf_counter()
        try:
            return wait(host_tokens)
        finally:
            timer.totals["wait"] += time.perf_counter() - begin

    HostTokens.wait = timed_wait
    graphs = getattr(engine.runner, "graphs", None)
    replays = graphs.num_replays if graphs is not None else 0
    start, stamps, elapsed, _ = run_requests(engine, prompts, out_tokens, output_kind=output_kind)
    num_tokens = sum(len(t) for t in stamps.values())
    gpu = recorder.gpu_times()
    summary = step_summary(recorder, gpu, start, engine.options.async_scheduling)
    summary["graph_replays"] = graphs.num_replays - replays if graphs is not None else 0
    summary["host_s"] = {phase: round(seconds, 3) for phase, seconds in timer.totals.items()}
    if tail:
        summary["tail"] = tail_steps(recorder, gpu, start, tail)
    summary.update(gc_timer.close())
    summary.update(compiles.close())
    if sampler is not None:
        summary.update(sampler.close())
    recorder.close()
    timer.close()
    HostTokens.wait = wait
    return summary, elapsed, num_tokens


def kernel_profile(engine, prompts, out_tokens: int, top: int, output_kind: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        _, _, elapsed, _ = run_requests(engine, prompts, out_tokens, output_kind=output_kind)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total_s = sum(e.self_device_time_total for e in kernels) / 1e6
    busy_s = busy_us(kernel_events(prof)) / 1e6
    return {"elapsed_s": round(elapsed, 3), "kernel_s": round(total_s, 3), "busy_s": round(busy_s, 3),
            "gpu_busy": round(busy_s / elapsed, 3),
            "top": [{"kernel": e.key[:120], "s": round(e.self_device_time_total / 1e6, 3), "calls": e.count}
                    for e in kernels[:top]]}


def profile_artifact(path: Path, options: dict, args) -> dict:
    inp, out, num = parse_throughput(args.throughput)[0]
    output_kind = options.pop("output_kind", args.output_kind)  # the requests', not the engine's
    llm = LLM(path, device=args.device, **options)
    engine = llm.engine
    warm_up(engine, min(num, engine.options.max_num_seqs), min(inp, 64))
    prompts = random_prompts(num, inp, engine.manifest.model.vocab_size, seed=inp + out)
    steps, elapsed, num_tokens = run_once(engine, prompts, out, output_kind, args.tail, args.clocks)
    result = {"workload": args.throughput, "output_kind": output_kind, "elapsed_s": round(elapsed, 3),
              "output_tokens_per_s": round(num_tokens / elapsed, 1), "async_scheduling": engine.options.async_scheduling,
              "max_num_seqs": engine.options.max_num_seqs,
              "max_num_batched_tokens": engine.options.max_num_batched_tokens, "steps": steps}
    if args.kernels and engine.device.type == "cuda":
        # new prompts: the first run's are in the prefix cache
        prompts = random_prompts(num, inp, engine.manifest.model.vocab_size, seed=inp + out + 1)
        result["kernels"] = kernel_profile(engine, prompts, out, args.top, output_kind)
    llm.close()
    return result


def summary_lines(label: str, r: dict) -> list[str]:
    s = r["steps"]
    lines = [f"{label}: {r['output_tokens_per_s']} output tokens/s in {r['elapsed_s']} s; graph replays "
             f"{s['graph_replays']}; host s {s['host_s']}; gc s {s['gc_s_by_generation']} ({s['gc_count_by_generation']}); "
             f"triton compiles {s['triton_compiles']} ({s['triton_compile_s']} s) {s['triton_compiled']}"]
    lines += [f"  {kind}: {s[kind]}" for kind in ("decode", "mixed", "clocks") if kind in s]
    lines += [f"    step {t['step']}: {t}" for t in s.get("tail", ())]
    if "kernels" in r:
        k = r["kernels"]
        lines.append(f"  kernels: {k['kernel_s']} s summed, some kernel running {k['busy_s']} s of {k['elapsed_s']} s "
                     f"(GPU busy {k['gpu_busy']})")
        lines += [f"    {t['s']:8.3f} s {t['calls']:7d}  {t['kernel']}" for t in k["top"]]
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    results = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    for item in args.artifacts:
        path, _, label = item.partition("=")
        label, _, extra = label.partition("@")
        label = label or Path(path).name
        options = {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                   "max_model_len": args.max_model_len, "disable_log_stats": True, **parse_engine_options(extra)}
        log(f"{label}: {args.throughput}")
        results[label] = profile_artifact(Path(path), options, args)
        print("\n".join(summary_lines(label, results[label])), flush=True)
        args.json.write_text(json.dumps(results, indent=1))
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
