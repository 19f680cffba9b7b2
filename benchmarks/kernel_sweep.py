"""Sweep candidate kernel configurations on the GPU (issue 13): W4A16 "swap" (tensor cores, weight as
the register operand) and "rows" (CUDA cores, one token) and the FP8 small-M kernel, against torch
bf16 and today's dispatch, with the timer of bench_kernels.py (CUDA-graph replays, cold L2, median).

    python benchmarks/kernel_sweep.py --out $OUT [--ms 1 4 16 64 256]

Prints, per shape and M, the best candidate of each kind and its speed-up over bf16; writes every
candidate's time to kernel_sweep.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from llmc.kernels.fp8 import fp8_linear, quantize_fp8_per_token
from llmc.kernels.fp8_triton import fp8_linear_small_m
from llmc.kernels.timing import make_l2_flush_buffer, median_time_ms
from llmc.kernels.w4a16_gemm import w4a16_linear
from llmc.kernels.w4a16_triton import launch_w4a16_gemm

from bench_kernels import GROUP_SIZE, SHAPES, make_weights


def w4_candidates(m: int):
    """(kind, block_m, block_n, split_k, num_warps, num_stages)."""
    if m <= 4:
        for tiles, bn, split, warps in itertools.product((2, 4, 8), (32, 64, 128), (1, 2, 4, 8), (4, 8)):
            if tiles * bn <= 512:
                yield ("rows", tiles, bn, split, warps, 1)
    block_ms = (16,) if m <= 16 else ((32, 64) if m <= 64 else (64, 128))
    for bm, bn, split, stages in itertools.product(block_ms, (64, 128), (1, 2, 4, 8, 16), (3, 4)):
        if m > 64 and split > 2:
            continue
        yield ("swap", bm, bn, split, 4 if bn == 64 or bm < 128 else 8, stages)


def fp8_candidates(m: int):
    for bn, bk, split, stages in itertools.product((64, 128), (128, 256), (1, 2, 4, 8), (3, 4)):
        yield (bn, bk, split, 4, stages)


def rel_err(y, ref) -> float:
    return float((y.float() - ref.float()).norm() / ref.float().norm())


def sweep_shape(k: int, n: int, ms: list[int], flush, with_w4: bool = True) -> list[dict]:
    weights = make_weights(k, n)
    dense, w4, fp8 = weights["dense"], weights["w4"], weights["fp8"]
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, dense)
        fp8_ref = fp8_linear(x, fp8["weight"], fp8["weight_scale"], None)
        base = {
            "bf16": median_time_ms(lambda: F.linear(x, dense), flush) * 1e3,
            "w4_today": median_time_ms(lambda: w4a16_linear(x, w4["qweight"], w4["scales"], None, None, GROUP_SIZE), flush) * 1e3,
            "fp8_today": median_time_ms(lambda: fp8_linear(x, fp8["weight"], fp8["weight_scale"], None), flush) * 1e3,
        }
        row = {"K": k, "N": n, "M": m, **{name: round(us, 2) for name, us in base.items()}, "w4": [], "fp8": []}
        for config in w4_candidates(m) if with_w4 else ():
            kind, bm, bn, split, warps, stages = config
            # rows: the second field is its K tiles per load (block_m is unused there)
            fn = lambda: launch_w4a16_gemm(x, w4["qweight"], w4["scales"], None, None, GROUP_SIZE, kind, bm, bn, split,  # noqa: E731
                                           warps, stages, k_tiles=bm if kind == "rows" else 1)
            try:
                err = rel_err(fn(), ref)
                us = median_time_ms(fn, flush) * 1e3
            except Exception as exc:  # a config the compiler refuses (shared memory, registers)
                row["w4"].append({"config": config, "error": str(exc)[:120]})
                continue
            row["w4"].append({"config": config, "us": round(us, 2), "err": round(err, 5)})
        if m <= 64:
            for config in fp8_candidates(m):
                bn, bk, split, warps, stages = config
                fn = lambda: fp8_linear_small_m(*quantize_fp8_per_token(x), fp8["weight"], fp8["weight_scale"], None, x.dtype, bn, bk, split, warps, stages)  # noqa: E731
                try:
                    err = rel_err(fn(), fp8_ref)
                    us = median_time_ms(fn, flush) * 1e3
                except Exception as exc:
                    row["fp8"].append({"config": config, "error": str(exc)[:120]})
                    continue
                row["fp8"].append({"config": config, "us": round(us, 2), "err": round(err, 5)})
        rows.append(row)
        print(summary_line(row), flush=True)
    return rows


def best(entries, kind=None):
    ok = [e for e in entries if "us" in e and (kind is None or e["config"][0] == kind) and e["err"] < 2e-2]
    return min(ok, key=lambda e: e["us"]) if ok else None


def summary_line(row: dict) -> str:
    bf16 = row["bf16"]
    parts = [f"{row['K']}x{row['N']} M={row['M']}: bf16 {bf16:.1f}us w4_today {bf16 / row['w4_today']:.2f}x"]
    for kind in ("rows", "swap"):
        b = best(row["w4"], kind)
        if b:
            parts.append(f"{kind} {bf16 / b['us']:.2f}x ({b['us']:.1f}us {b['config'][1:]} err {b['err']:.1e})")
    parts.append(f"fp8_today {bf16 / row['fp8_today']:.2f}x")
    b = best(row["fp8"])
    if b:
        parts.append(f"fp8_small {bf16 / b['us']:.2f}x ({b['us']:.1f}us {b['config']} err {b['err']:.1e})")
    return " | ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    parser.add_argument("--no-w4", action="store_true", help="only the FP8 candidates")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    flush = make_l2_flush_buffer()
    rows = []
    for k, n in SHAPES:
        rows += sweep_shape(k, n, args.ms, flush, not args.no_w4)
        (args.out / "kernel_sweep.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(summary_line(row) for row in rows))


if __name__ == "__main__":
    main()
