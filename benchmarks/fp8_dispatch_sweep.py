"""Issue 13, FP8 W8A8 never slower than bf16: which FP8 path is fastest at each (K, N, M)?

    python benchmarks/fp8_dispatch_sweep.py --json OUT/fp8_dispatch_sweep.json [--quick]

For the Llama-3-8B linear shapes and M tokens, one run, the bench_kernels timer (CUDA-graph replays,
cold L2, medians; kernels/timing.py). Every FP8 candidate includes the per-token activation
quantization (kernels/fp8.quantize_fp8_per_token), as the model's linears run it:
- "triton BM/BN/BK/split/warps/stages": kernels/fp8_triton.fp8_linear_small_m with those tiles;
- "scaled_mm": torch._scaled_mm(x, w.T) with row-wise scales (cuBLAS);
- "scaled_mm_t": the same product with the operands swapped, y.T = w @ x.T, then y made contiguous.
The quantization alone and torch._scaled_mm without it are timed too (quant_only_us,
scaled_mm_without_quant_us), to show what each costs, and kernels/fp8.fp8_linear as the table
dispatches it (dispatch_us).
bf16 is torch F.linear on the dequantized weight. Prints, per (K, N, M), bf16's time, the best
candidate and its speed-up; the JSON keeps every candidate's time, and its "table" the dispatch
table `compact_table` draws from them (kernels/fp8.DEFAULT_FP8_TABLE is one):

    python benchmarks/fp8_dispatch_sweep.py --table-from OUT/fp8_dispatch_sweep.json   # no GPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import SHAPES, make_weights  # noqa: E402

from llmc.kernels.fp8 import fp8_linear, quantize_fp8_per_token  # noqa: E402
from llmc.kernels.fp8_triton import fp8_linear_small_m  # noqa: E402
from llmc.kernels.timing import make_l2_flush_buffer, median_time_ms  # noqa: E402

MS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024, 2048, 4096]


def triton_configs(m: int, k: int, quick: bool):
    for bm, bn, bk, split, warps, stages in itertools.product(
        (16, 32, 64, 128), (64, 128), (128, 256), (1, 2, 4), (4, 8), (3, 4)
    ):
        if bm > max(16, m) or (quick and (warps == 8 or stages == 4)):
            continue
        if (split > 1 and m > 256) or (bm == 128 and (bn, bk) == (128, 256) and stages == 4):
            continue  # split-K only helps while tokens are few; the last tile exceeds shared memory
        yield f"triton {bm}/{bn}/{bk}/{split}/{warps}/{stages}", dict(
            block_m=bm, block_n=bn, block_k=bk, split_k=split, num_warps=warps, num_stages=stages)


def scaled_mm(x, w, w_scale_row):
    xq, xs = quantize_fp8_per_token(x)
    return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=w_scale_row, out_dtype=x.dtype)


def scaled_mm_t(x, w, w_scale_col):
    xq, xs = quantize_fp8_per_token(x)
    yt = torch._scaled_mm(w, xq.t(), scale_a=w_scale_col, scale_b=xs.t().contiguous(), out_dtype=x.dtype)
    return yt.t().contiguous()


def compact_table(rows: list[dict], tolerance: float = 0.03) -> dict:
    """{"KxN": [[max_m, config], ...]}: per shape, ranges of the swept M, each served by one candidate
    within `tolerance` of the fastest at every M of the range (the longest such run first), so that
    noise between near-equal tiles does not split the table. config: "scaled_mm" or the Triton tiles."""
    table = {}
    for shape in dict.fromkeys(f"{r['K']}x{r['N']}" for r in rows):
        cells = [r for r in rows if f"{r['K']}x{r['N']}" == shape]
        good = [{name for name, t in r["times_us"].items() if name != "bf16" and t <= r["best_us"] * (1 + tolerance)}
                for r in cells]
        entries, i = [], 0
        while i < len(cells):
            def run_length(name):
                j = i
                while j < len(cells) and name in good[j]:
                    j += 1
                return j - i
            name = max(sorted(good[i]), key=lambda n: (run_length(n), -cells[i]["times_us"][n]))
            i += run_length(name)
            entries.append([cells[i - 1]["M"], name if name == "scaled_mm" else _tiles(name)])
        table[shape] = entries
    return table


def _tiles(name: str) -> dict:
    bm, bn, bk, split, warps, stages = map(int, name.split()[1].split("/"))
    return dict(block_m=bm, block_n=bn, block_k=bk, split_k=split, num_warps=warps, num_stages=stages)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quick", action="store_true", help="4 warps and 3 stages only")
    parser.add_argument("--ms", default=",".join(map(str, MS)))
    parser.add_argument("--table-from", type=Path, help="only print the dispatch table of an earlier run's JSON")
    args = parser.parse_args(argv)
    if args.table_from:
        print(json.dumps(compact_table(json.loads(args.table_from.read_text())["rows"])))
        return 0
    flush = make_l2_flush_buffer()
    rows = []
    for k, n in SHAPES:
        weights = make_weights(k, n)
        dense, w, w_scale = weights["dense"], weights["fp8"]["weight"], weights["fp8"]["weight_scale"]
        w_scale_row, w_scale_col = w_scale.reshape(1, -1).contiguous(), w_scale.reshape(-1, 1).contiguous()
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.float(), dense.float())
            quant_us = round(1000 * median_time_ms(lambda: quantize_fp8_per_token(x), flush), 2)
            xq, xs = quantize_fp8_per_token(x)
            gemm_us = round(1000 * median_time_ms(
                lambda: torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=w_scale_row, out_dtype=x.dtype), flush), 2)
            runs = {"bf16": lambda: F.linear(x, dense),
                    "scaled_mm": lambda: scaled_mm(x, w, w_scale_row),
                    "scaled_mm_t": lambda: scaled_mm_t(x, w, w_scale_col)}
            for name, config in triton_configs(m, k, args.quick):
                runs[name] = lambda config=config: fp8_linear_small_m(
                    *quantize_fp8_per_token(x), w, w_scale, None, x.dtype, **config)
            times, errors = {}, {}
            for name, fn in runs.items():
                try:
                    err = float((fn().float() - ref).norm() / ref.norm())
                    if err > 0.1:
                        errors[name] = f"relative error {err:.3f}"
                        continue
                    times[name] = round(1000 * median_time_ms(fn, flush), 2)
                except Exception as exc:  # noqa: BLE001 - a sweep: record why and go on
                    errors[name] = str(exc)[:200]
            dispatch_us = round(1000 * median_time_ms(lambda: fp8_linear(x, w, w_scale, None), flush), 2)
            fp8_times = {name: t for name, t in times.items() if name != "bf16"}
            best = min(fp8_times, key=fp8_times.get)
            row = {"K": k, "N": n, "M": m, "bf16_us": times.get("bf16"), "best": best, "best_us": fp8_times[best],
                   "speedup": round(times["bf16"] / fp8_times[best], 3),
                   "scaled_mm_speedup": round(times["bf16"] / fp8_times["scaled_mm"], 3) if "scaled_mm" in fp8_times else None,
                   "dispatch_us": dispatch_us, "dispatch_speedup": round(times["bf16"] / dispatch_us, 3),
                   "quant_only_us": quant_us, "scaled_mm_without_quant_us": gemm_us,
                   "times_us": times, "errors": errors}
            print(f"{k}x{n} M={m}: bf16 {row['bf16_us']} us, fp8_linear as dispatched {dispatch_us} us "
                  f"({row['dispatch_speedup']}x), best {best} {row['best_us']} us "
                  f"({row['speedup']}x; scaled_mm {row['scaled_mm_speedup']}x; quant {quant_us} us, "
                  f"scaled_mm without it {gemm_us} us)", flush=True)
            rows.append(row)
    table = compact_table(rows)
    print(json.dumps(table))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                         "rows": rows, "table": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
