"""One W4A16 kernel kind's tuner candidates against bf16 and the recorded table, on the GPU.

    python benchmarks/w4a16_kind_sweep.py --kind wgmma --json OUT.json [--ms 64 256 1024]
    python benchmarks/w4a16_kind_sweep.py --configs wgmma,256,128,1,8,3,1 ... --json OUT.json

For the Llama-3-8B linear shapes and each M: torch bf16 F.linear, the config DEFAULT_W4A16_TABLE picks
today, and every candidate of the tuner (w4a16_tune.candidate_configs) of that kind (or the configs
named), each checked
against dequantize + F.linear first (relative error < 1e-2, the tuner's check). Same timer as
bench_kernels and the tuner (CUDA-graph replays, cold L2, medians). Prints, per cell, the ratios
bf16 time ÷ kernel time and writes every timed candidate to the JSON. Session 14 swept two kernels
with it that were then removed: the shared-memory operand (commit 94277c4, this script's first
version) and stream-K (commit 0b71097); benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from llmc.kernels import device_num_sms
from llmc.kernels.timing import make_l2_flush_buffer, median_time_ms
from llmc.kernels.w4a16_gemm import W4A16Config, pack_w4a16_for_gpu, run_w4a16_config, select_w4a16_config
from llmc.kernels.w4a16_triton import launch_w4a16_dequantize
from llmc.kernels.w4a16_tune import candidate_configs, check_and_time

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]


def parse_shapes(specs: list[str] | None, default: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """--shapes KxN ... as (K, N) pairs; `default` where none are named."""
    return [tuple(int(v) for v in spec.split("x")) for spec in specs] if specs else default


def parse_config(spec: str) -> W4A16Config:
    kind, *numbers = spec.split(",")
    flags = dict(zip(("is_stacked", "scale_acc"), (bool(int(v)) for v in numbers[5:])))
    return W4A16Config(kind, *(int(v) for v in numbers[:5]), **flags)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    parser.add_argument("--kind", default="wgmma")
    parser.add_argument("--configs", nargs="+", default=None,
                        help="configs to time at every M instead of the kind's tuner candidates: "
                             "kind,block_m,block_n,split_k,num_warps,num_stages[,is_stacked 0/1[,scale_acc 0/1]]")
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 16, 64, 128, 256, 512, 1024, 4096])
    parser.add_argument("--shapes", nargs="+", default=None, help="KxN, e.g. 5120x15360 (default: Llama-3-8B's four)")
    args = parser.parse_args()
    torch.manual_seed(0)
    num_sms = device_num_sms(torch.device("cuda"))
    flush = make_l2_flush_buffer(torch.device("cuda"))
    records, rows = [], []
    for k, n in parse_shapes(args.shapes, SHAPES):
        levels = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda")
        scales = (torch.rand(n, k // 128, device="cuda") * 0.004 + 0.001).to(torch.bfloat16)
        params = pack_w4a16_for_gpu(levels, scales, None)
        qweight, qscales = params["qweight"], params["scales"]
        dense = launch_w4a16_dequantize(qweight, qscales, None, k, 128).to(torch.bfloat16)
        for m in args.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            expected = F.linear(x, dense).float()
            bf16_us = median_time_ms(lambda: F.linear(x, dense), flush) * 1000

            def timed(config: W4A16Config) -> float | None:
                run = lambda: run_w4a16_config(x, qweight, qscales, None, None, 128, config)  # noqa: E731
                result = check_and_time(run, expected, flush, f"{k}x{n} m={m} {config}")
                if result is None:
                    return None
                us, error = result[0] * 1000, result[1]
                records.append({"K": k, "N": n, "M": m, "config": config.to_dict(), "us": round(us, 2),
                                "error": error})
                return us

            table_config = select_w4a16_config(m, k, n, None, num_sms)
            table_us = timed(table_config)
            kind = ([parse_config(spec) for spec in args.configs] if args.configs else
                    [c for c in candidate_configs(m, k, n, num_sms, wgmma=True) if c.kind == args.kind])
            kind = [(us, c) for c in kind if (us := timed(c)) is not None]
            best_us, best = min(kind, key=lambda item: item[0]) if kind else (None, None)
            row = {"K": k, "N": n, "M": m, "bf16_us": round(bf16_us, 2), "table": table_config.to_dict(),
                   "table_us": table_us and round(table_us, 2), "kind_best": best and best.to_dict(),
                   "kind_us": best_us and round(best_us, 2)}
            rows.append(row)
            print(f"{k}x{n} M={m}: bf16 {bf16_us:.1f} us | table {table_config.kind} {table_us or 0:.1f} us "
                  f"({bf16_us / table_us if table_us else 0:.2f}x) | {args.configs and 'named' or args.kind} best {best_us or 0:.1f} us "
                  f"({bf16_us / best_us if best_us else 0:.2f}x) {best}", flush=True)
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "candidates": records}, f, indent=1)


if __name__ == "__main__":
    main()
