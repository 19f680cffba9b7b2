"""Greedy sampling's argmax over a Llama-3 vocabulary (128,256 float32 logits a row) on the GPU:
torch.argmax(dim=-1) against kernels.sampling.argmax_rows, same inputs, same process, each the
median of 25 CUDA-graph replays (kernels/timing.py) with the logits left in L2, as the output head
leaves them; the two results are checked equal first.

    source benchmarks/gpu_env.sh && python benchmarks/argmax_bench.py [--rows 1,64,256] [--chunks 1024,4096]
        [--json OUT.json]

--chunks times argmax_rows with kernels/sampling_triton.CHUNK set to each (entries a program reads).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from llmc.kernels import sampling_triton
from llmc.kernels.sampling import argmax_rows
from llmc.kernels.timing import median_time_ms

VOCAB = 128256


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,64,256")
    parser.add_argument("--chunks", default=None, help="comma-separated sampling_triton.CHUNK values")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    results = {"device": torch.cuda.get_device_name(), "vocab": VOCAB, "us": {}}
    for rows in (int(r) for r in args.rows.split(",")):
        logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(rows)).cuda()
        if not torch.equal(argmax_rows(logits), logits.argmax(dim=-1)):
            raise SystemExit(f"argmax_rows differs from torch.argmax at {rows} rows")
        chunks = [int(c) for c in args.chunks.split(",")] if args.chunks else [sampling_triton.CHUNK]
        variants = [("torch.argmax", None, lambda: logits.argmax(dim=-1))]
        variants += [(f"argmax_rows chunk {c}", c, lambda: argmax_rows(logits)) for c in chunks]
        for name, chunk, fn in variants:
            if chunk is not None:
                sampling_triton.CHUNK = chunk
            us = median_time_ms(fn, None) * 1000
            results["us"][f"{rows} {name}"] = round(us, 2)
            print(f"{rows:4d} rows {name:>22}: {us:7.2f} µs", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
