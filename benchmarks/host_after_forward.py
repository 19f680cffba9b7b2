"""What an engine step's host work costs on a CPU right after a forward, whose weights evict the caches.

    python benchmarks/host_after_forward.py ARTIFACT [--batch-sizes 1,16] [--buffer-mb 0,8,64,256] [--steps 300]

The engine decodes B greedy sequences with the forward replaced by its first result (cached logits), so
what is left of a step is the host's own work (scheduling, input building, sampling, resolving); in
place of the forward the step reads a float32 buffer of --buffer-mb MB, as a forward reads its weights
(ref-llama-12m: 50 MB). Prints, per batch size and buffer, the host milliseconds per step and the
phases' share. Run it pinned to the cores the forward would use (taskset, OMP_NUM_THREADS), as
benchmarks/cpu_step_ratio.sh does.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from llmc.runtime.engine import Engine
from llmc.runtime.sampling_params import SamplingParams

PHASES = {"build": ("runner.buffers", "build"), "resolve": ("", "_resolve"), "schedule": ("scheduler", "schedule"),
          "sample": ("sampler", "sample"), "advance": ("scheduler", "advance")}


def measure(artifact, batch_size: int, buffer_mb: int, steps: int) -> dict:
    engine = Engine(artifact, device="cpu", max_num_seqs=max(batch_size, 4), max_model_len=512,
                    disable_log_stats=True, max_num_batched_tokens=8192)
    rng = random.Random(0)
    vocab = engine.manifest.model.vocab_size
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=400)
    for _ in range(batch_size):
        engine.add_request(None, params, prompt_token_ids=[rng.randrange(vocab) for _ in range(32)])
    for _ in range(8):  # the prompts, then decodes only
        engine.step()
    forward, cached = engine.runner.forward_logits, {}
    sweep = torch.ones(buffer_mb * 2**18) if buffer_mb else None
    totals = dict.fromkeys(["forward", *PHASES], 0.0)

    def replaced(input_ids, forward_batch, dtype=torch.float32):
        start = time.perf_counter()
        if sweep is not None:
            sweep.sum()
        key = input_ids.shape[0]
        if key not in cached:
            cached[key] = forward(input_ids, forward_batch, dtype)
        totals["forward"] += time.perf_counter() - start
        return cached[key]

    engine.runner.forward_logits = replaced
    for phase, (path, name) in PHASES.items():
        owner = engine
        for attr in filter(None, path.split(".")):
            owner = getattr(owner, attr)
        method = getattr(owner, name)

        def timed(*args, _method=method, _phase=phase, **kwargs):
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                totals[_phase] += time.perf_counter() - start

        setattr(owner, name, timed)
    for _ in range(5):
        engine.step()
    totals = dict.fromkeys(totals, 0.0)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - start
    engine.close()
    per_step = lambda seconds: round(1000 * seconds / steps, 3)  # noqa: E731
    return {"batch_size": batch_size, "buffer_mb": buffer_mb, "host_ms": per_step(wall - totals.pop("forward")),
            **{f"{phase}_ms": per_step(total) for phase, total in totals.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("artifact")
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--buffer-mb", default="0,8,64,256")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    for batch_size in map(int, args.batch_sizes.split(",")):
        for buffer_mb in map(int, args.buffer_mb.split(",")):
            print(measure(args.artifact, batch_size, buffer_mb, args.steps), flush=True)


if __name__ == "__main__":
    main()
