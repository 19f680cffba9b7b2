"""The persistent batch sampler's host cost when rows join and leave (issue 12), on the CPU.

    python benchmarks/sampler_refresh.py [--rows 1024] [--churn 60] [--steps 50]

A BatchSampler with --rows plain greedy rows; each step --churn random rows leave and join again, then
the refresh runs (is_plain_greedy() refreshes the device copies and the summary when a row changed).
Prints ms per step and ms per refresh alone (no row changed, the refresh forced). Compare trees by
running it on each in turn.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from llmc.runtime.batch_sampler import BatchSampler
from llmc.runtime.sampling_params import SamplingParams


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--churn", type=int, default=60)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args(argv)
    sampler = BatchSampler(args.rows, 32000, torch.device("cpu"), [2])
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    for row in range(args.rows):
        sampler.add(row, params, [1, 2, 3], [])
    sampler.is_plain_greedy()
    rng = random.Random(0)
    start = time.perf_counter()
    for _ in range(args.steps):
        rows = rng.sample(range(args.rows), args.churn)
        for row in rows:
            sampler.remove(row)
        for row in rows:
            sampler.add(row, params, [1, 2, 3], [])
        sampler.is_plain_greedy()
    per_step = (time.perf_counter() - start) / args.steps * 1000
    start = time.perf_counter()
    for _ in range(args.steps):
        sampler._is_dirty = True
        sampler.is_plain_greedy()
    per_refresh = (time.perf_counter() - start) / args.steps * 1000
    print(f"{args.rows} rows, {args.churn} leaving and joining per step: {per_step:.2f} ms per step, "
          f"{per_refresh:.2f} ms per refresh alone")


if __name__ == "__main__":
    main()
