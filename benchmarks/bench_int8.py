"""W8A8 int8 (`kernels/int8.int8_linear`: per-token int8 quantization of x, torch._int_mm, the float32 scale
epilogue) against torch's bf16 F.linear and llmc's FP8 W8A8 linear on Llama-3-8B's four GEMM shapes, with
bench_kernels' timer (CUDA-graph replays, cold L2, median). A GPU benchmark; prints a table and writes JSON.

    python -P benchmarks/bench_int8.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.append(str(Path(__file__).resolve().parents[1]))

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # K x N: qkv, o, gate_up, down
MS = [1, 16, 64, 256, 1024, 4096]


def main() -> None:
    from llmc.kernels.fp8 import fp8_linear
    from llmc.kernels.int8 import int8_linear
    from llmc.kernels.timing import make_l2_flush_buffer, median_time_ms

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    flush = make_l2_flush_buffer()
    rows = []
    print(f"{'K x N':>12} {'M':>5} {'bf16 us':>9} {'fp8 us':>9} {'int8 us':>9} {'int8/bf16':>9} {'int8/fp8':>9}")
    for k, n in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        w_scale = w.float().abs().amax(dim=1, keepdim=True) / 127
        w_int8 = torch.round(w.float() / w_scale).clamp(-127, 127).to(torch.int8)
        w_fp8_scale = w.float().abs().amax(dim=1, keepdim=True) / 448
        w_fp8 = (w.float() / w_fp8_scale).to(torch.float8_e4m3fn)
        for m in MS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            bf16 = median_time_ms(lambda: F.linear(x, w), flush) * 1e3
            int8 = median_time_ms(lambda: int8_linear(x, w_int8, w_scale, None), flush) * 1e3
            try:
                fp8 = median_time_ms(lambda: fp8_linear(x, w_fp8, w_fp8_scale, None), flush) * 1e3
            except Exception as e:  # noqa: BLE001 - the comparison column only
                print(f"fp8 failed: {type(e).__name__}: {e}", file=sys.stderr)
                fp8 = float("nan")
            row = {"k": k, "n": n, "m": m, "bf16_us": round(bf16, 2), "fp8_us": round(fp8, 2),
                   "int8_us": round(int8, 2)}
            rows.append(row)
            print(f"{k:>5} x {n:<5} {m:>5} {bf16:9.1f} {fp8:9.1f} {int8:9.1f} {bf16 / int8:9.2f} {fp8 / int8:9.2f}",
                  flush=True)
    Path(args.out, "bench_int8.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                                            indent=1))


if __name__ == "__main__":
    main()
