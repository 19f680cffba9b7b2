"""The engine's host time per step, with the model's forward replaced by constant logits (issue 12).

    python benchmarks/host_cost.py [ARTIFACT] [--batch 512] [--repeats 3] [--output-kind delta|cumulative|final_only] \
        [--churn]

Loads ARTIFACT (default build/ref-llama-12m, from `llmc build recipes/ref-llama-12m.yaml`) on the CPU
with max_num_seqs --batch, replaces `runner.forward_logits` by a function that returns the same
constant logits every call (token 5 wins), and runs bench_e2e's throughput workload (2 x --batch
requests of 128 random prompt tokens, 128 output tokens each, all submitted at once) --repeats times.
What is left per `Engine.step()` is the host's own work: scheduling, building the step's inputs,
sampling, detokenizing, stops, outputs (of --output-kind: final_only is what LLM.generate asks for,
delta what a stream needs). --churn instead: 3 x --batch requests of 64 prompt tokens and 16-256
output tokens each (uniform, seeded), so that rows leave and join at almost every step, as in
serving. Prints the median ms per step, and of it the engine's phases (profile_step.PhaseTimer: schedule,
execute = building the step's inputs and launching, sample, advance, resolve = tokens, detokenization,
stops and outputs; the timers add a little). With final_only outputs also the time `_resolve` spends per
finished request beyond its row's usual share (the final detokenization, the output, freeing its blocks and
its row), which shows as GPU idle in a throughput run's last steps. Compare trees by running it on each in turn on a quiet
machine.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_e2e import random_prompts, run_requests, warm_up  # noqa: E402
from profile_step import PhaseTimer  # noqa: E402

from llmc.runtime.llm import LLM  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", nargs="?", default="build/ref-llama-12m")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output-kind", default="delta", choices=["cumulative", "delta", "final_only"])
    parser.add_argument("--churn", action="store_true", help="16-256 output tokens per request: rows change every step")
    args = parser.parse_args(argv)
    blocks_per_seq = -(-(64 + 256 if args.churn else 128 + 128) // 16) + 1
    llm = LLM(args.artifact, device="cpu", max_num_seqs=args.batch, max_num_batched_tokens=8192, max_model_len=512,
              block_size=16, num_kv_blocks=args.batch * blocks_per_seq + 64, disable_log_stats=True)
    engine = llm.engine
    vocab_size = engine.manifest.model.vocab_size
    logits: dict[int, torch.Tensor] = {}

    def constant_logits(input_ids, forward_batch, dtype=None):
        num_rows = forward_batch.logits_indices.shape[0]
        if num_rows not in logits:
            logits[num_rows] = torch.zeros(num_rows, vocab_size)
            logits[num_rows][:, 5] = 1.0
        return logits[num_rows]

    engine.runner.forward_logits = constant_logits
    warm_up(engine, 64, 16)
    step, per_step, phases, finish_us = engine.step, [], [], []
    timer = PhaseTimer(engine)  # one for every repeat: closing it would take the constant logits off too
    resolve, resolves = engine._resolve, []

    def timed_resolve(in_flight):
        start = time.perf_counter()
        outputs = resolve(in_flight)
        resolves.append((time.perf_counter() - start, len(outputs), len(in_flight.requests) if in_flight else 0))
        return outputs

    engine._resolve = timed_resolve
    for repeat in range(args.repeats):
        num_steps = 0

        def counted_step():
            nonlocal num_steps
            num_steps += 1
            return step()

        engine.step = counted_step
        if args.churn:
            rng = random.Random(repeat)
            prompts = random_prompts(3 * args.batch, 64, vocab_size, seed=10 + repeat)
            max_tokens = [rng.randrange(16, 257) for _ in prompts]
        else:
            prompts, max_tokens = random_prompts(2 * args.batch, 128, vocab_size, seed=10 + repeat), 128
        timer.reset()
        resolves.clear()
        _, _, elapsed, _ = run_requests(engine, prompts, max_tokens, output_kind=args.output_kind)
        finish_us.append(finish_cost_us(resolves) if args.output_kind == "final_only" else float("nan"))
        per_step.append(1000 * elapsed / num_steps)
        phases.append({phase: 1000 * seconds / num_steps for phase, seconds in timer.totals.items() if phase != "forward"})
    engine.step = step
    vars(engine).pop("_resolve")
    llm.close()
    print(f"batch {args.batch}{', churn' if args.churn else ''}, {args.output_kind} outputs: host ms per step {statistics.median(per_step):.2f} "
          f"(runs {[round(x, 2) for x in per_step]}, {num_steps} steps each); by phase, median ms per step "
          f"{ {phase: round(statistics.median(p[phase] for p in phases), 2) for phase in phases[0]} }")
    if args.output_kind == "final_only":
        print(f"  resolve's time per finished request beyond its row's: median {statistics.median(finish_us):.1f} us "
              f"(runs {[round(x, 1) for x in finish_us]})")
    return 0


def finish_cost_us(resolves: list[tuple[float, int, int]]) -> float:
    """(seconds, outputs, rows) per `_resolve` call of a final-only run → µs per finished request beyond
    the per-row time of the calls where none finished (the median over the calls where some did)."""
    quiet = [seconds / rows for seconds, outputs, rows in resolves if outputs == 0 and rows]
    per_row = statistics.median(quiet) if quiet else 0.0
    costs = [(seconds - rows * per_row) / outputs for seconds, outputs, rows in resolves if outputs]
    return 1e6 * statistics.median(costs) if costs else float("nan")


if __name__ == "__main__":
    sys.exit(main())
