"""Time chosen cells of bench_kernels' tables again, several rounds each, to tell a kernel that is slow
from a measurement that was (session 31: four W4A16 and three F.linear cells of the variant tables
came out 3-7x slower than their neighbours).

    python benchmarks/retime_cells.py --rounds 5 asym-g128-bf16:4096x4096:4 sym-g128-bf16:4096x4096:4

Each round captures a fresh CUDA graph of F.linear and of the W4A16 kernel and takes the bench_kernels
timer's median (kernels/timing.py). Rounds alternate with fresh inputs and weights (new allocations)
so that a cause tied to one allocation shows as one slow round. Prints every round's µs; JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import make_weights, parse_variant  # noqa: E402

from llmc.kernels.timing import make_l2_flush_buffer, median_time_ms  # noqa: E402
from llmc.kernels.w4a16_gemm import select_w4a16_config, w4a16_linear  # noqa: E402


def parse_cell(text: str) -> tuple[str, int, int, int]:
    try:
        variant, shape, m = text.split(":")
        k, n = (int(x) for x in shape.split("x"))
        parse_variant(variant)
        return variant, k, n, int(m)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise argparse.ArgumentTypeError(f"cell {text!r}: write VARIANT:KxN:M, e.g. asym-g128-bf16:4096x4096:4 ({exc})")


def retime(variant: str, k: int, n: int, m: int, rounds: int, flush) -> dict:
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    result = {"variant": variant, "K": k, "N": n, "M": m, "F.linear": [], "w4a16": [], "w4a16_no_graph": []}
    for r in range(rounds):
        weights = make_weights(k, n, variant)  # fresh allocations each round
        w4, dense, group_size = weights["w4"], weights["dense"], weights["group_size"]
        x = torch.randn(m, k, device="cuda", dtype=weights["dtype"])
        w4_fn = lambda: w4a16_linear(x, w4["qweight"], w4["scales"], w4.get("qzeros"), None, group_size, None)  # noqa: E731
        result["F.linear"].append(round(median_time_ms(lambda: F.linear(x, dense), flush) * 1000, 2))
        result["w4a16"].append(round(median_time_ms(w4_fn, flush) * 1000, 2))
        result["w4a16_no_graph"].append(round(median_time_ms(w4_fn, flush, use_graph=False) * 1000, 2))
        result["config"] = select_w4a16_config(m, k, n, None, num_sms).to_dict()
        del weights, w4, dense, x
    print(f"{variant} {k}x{n} M={m} {result['config']}\n  F.linear {result['F.linear']}\n  w4a16 {result['w4a16']}"
          f"\n  w4a16 without a graph {result['w4a16_no_graph']}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("cells", nargs="+", type=parse_cell, help="VARIANT:KxN:M")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    flush = make_l2_flush_buffer()
    results = [retime(*cell, args.rounds, flush) for cell in args.cells]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "retime_cells.json").write_text(json.dumps({"device": torch.cuda.get_device_name(0), "cells": results}, indent=1))


if __name__ == "__main__":
    main()
