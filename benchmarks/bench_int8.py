"""W8A8 int8 (`kernels/int8.int8_linear`) against torch's bf16 F.linear and llmc's FP8 W8A8 linear on Llama-3-8B's
four GEMM shapes, with bench_kernels' timer (CUDA-graph replays, cold L2, median). Two int8 columns: the torch path
(`triton=False`: per-token quantization as torch ops, torch._int_mm, the float32 scale epilogue as torch ops) and
the Triton path (int8_triton: one quantization kernel, the int8 GEMM with the epilogue fused, tiles from
`select_int8_kernel`); `same` says whether the two outputs are equal bit for bit. A GPU benchmark; prints a table
and writes JSON.

    python -P benchmarks/bench_int8.py --out DIR [--sweep]

--sweep also times the Triton GEMM alone (activations already quantized) at each tile set of SWEEP_TILES that
fits the kind M selects, next to the selected tiles, and records them all (for tuning `INT8_TILES`).
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


def _tiles(kind, block_m, block_n, block_k, num_warps, num_stages, split_k=1):
    return dict(kind=kind, block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps,
                num_stages=num_stages, split_k=split_k)


SWEEP_TILES = [  # few tokens: block_m must hold them (16 / 32 / 64); more: any
    _tiles("small_m", 16, 64, 256, 4, 4), _tiles("small_m", 16, 64, 256, 4, 4, 2),
    _tiles("small_m", 16, 128, 128, 8, 3), _tiles("small_m", 16, 128, 256, 8, 3),
    _tiles("small_m", 16, 64, 512, 4, 3), _tiles("small_m", 16, 32, 256, 4, 4),
    _tiles("small_m", 16, 64, 128, 4, 4, 4), _tiles("small_m", 16, 128, 128, 8, 3, 2),
    _tiles("small_m", 64, 64, 128, 4, 4), _tiles("small_m", 64, 128, 128, 8, 3),
    _tiles("large_m", 64, 128, 128, 4, 4), _tiles("large_m", 128, 128, 128, 8, 4),
    _tiles("large_m", 128, 128, 64, 8, 4), _tiles("large_m", 128, 256, 128, 8, 3),
    _tiles("large_m", 128, 256, 64, 8, 4), _tiles("large_m", 256, 128, 128, 8, 3),
]


def sweep(m, x, w_int8, w_scale, flush) -> list[dict]:
    """The Triton GEMM alone at each tile set of SWEEP_TILES that suits M (the few-token kernel's block_m
    at least M up to 64 tokens, never above; the tiled GEMM from 64 tokens), in µs; failures as NaN."""
    from llmc.kernels.int8 import quantize_int8_per_token
    from llmc.kernels.int8_triton import int8_gemm
    from llmc.kernels.timing import median_time_ms

    x_int8, x_scale = quantize_int8_per_token(x)
    xs, ws = x_scale.reshape(-1).contiguous(), w_scale.reshape(-1).contiguous()
    results = []
    for tiles in SWEEP_TILES:
        if tiles["kind"] == "small_m" and (m > 64 or tiles["block_m"] < min(m, 64) or tiles["block_m"] >= 2 * max(m, 16)):
            continue
        if tiles["kind"] == "large_m" and m < 64:
            continue
        try:
            us = median_time_ms(lambda: int8_gemm(x_int8, xs, w_int8, ws, None, x.dtype, **tiles), flush) * 1e3
        except Exception as e:  # noqa: BLE001 - a tile set that does not compile or fit
            print(f"  {tiles}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
            us = float("nan")
        results.append({**tiles, "us": round(us, 2)})
    return results


def main() -> None:
    from llmc.kernels import device_num_sms
    from llmc.kernels.fp8 import fp8_linear
    from llmc.kernels.int8 import int8_linear, select_int8_kernel
    from llmc.kernels.timing import make_l2_flush_buffer, median_time_ms

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sweep", action="store_true", help="also time the Triton GEMM at SWEEP_TILES")
    args = parser.parse_args()
    flush = make_l2_flush_buffer()
    num_sms = device_num_sms(torch.device("cuda"))
    rows = []
    print(f"{'K x N':>12} {'M':>5} {'bf16 us':>9} {'fp8 us':>9} {'int_mm us':>9} {'triton us':>9} {'same':>5} "
          f"{'tri/bf16':>8} {'tri/fp8':>8} {'tri/int_mm':>10}")
    for k, n in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        w_scale = w.float().abs().amax(dim=1, keepdim=True) / 127
        w_int8 = torch.round(w.float() / w_scale).clamp(-127, 127).to(torch.int8)
        w_fp8_scale = w.float().abs().amax(dim=1, keepdim=True) / 448
        w_fp8 = (w.float() / w_fp8_scale).to(torch.float8_e4m3fn)
        for m in MS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            bf16 = median_time_ms(lambda: F.linear(x, w), flush) * 1e3
            int_mm = median_time_ms(lambda: int8_linear(x, w_int8, w_scale, None, triton=False), flush) * 1e3
            try:
                triton_us = median_time_ms(lambda: int8_linear(x, w_int8, w_scale, None), flush) * 1e3
                same = torch.equal(int8_linear(x, w_int8, w_scale, None),
                                   int8_linear(x, w_int8, w_scale, None, triton=False))
            except Exception as e:  # noqa: BLE001 - the other columns still come
                print(f"triton failed: {type(e).__name__}: {str(e)[:500]}", file=sys.stderr)
                triton_us, same = float("nan"), None
            try:
                fp8 = median_time_ms(lambda: fp8_linear(x, w_fp8, w_fp8_scale, None), flush) * 1e3
            except Exception as e:  # noqa: BLE001 - the comparison column only
                print(f"fp8 failed: {type(e).__name__}: {e}", file=sys.stderr)
                fp8 = float("nan")
            row = {"k": k, "n": n, "m": m, "bf16_us": round(bf16, 2), "fp8_us": round(fp8, 2),
                   "int8_us": round(int_mm, 2), "int8_triton_us": round(triton_us, 2), "same": same,
                   "tiles": select_int8_kernel(m, k, n, num_sms)}
            print(f"{k:>5} x {n:<5} {m:>5} {bf16:9.1f} {fp8:9.1f} {int_mm:9.1f} {triton_us:9.1f} {str(same):>5} "
                  f"{bf16 / triton_us:8.2f} {fp8 / triton_us:8.2f} {int_mm / triton_us:10.2f}", flush=True)
            if args.sweep:
                row["sweep"] = sweep(m, x, w_int8, w_scale, flush)
                best = min(row["sweep"], key=lambda r: r["us"] if r["us"] == r["us"] else float("inf"))
                print(f"{'':>19} sweep best {best['us']:.1f} us at {best}", flush=True)
            rows.append(row)
    Path(args.out, "bench_int8.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                                            indent=1))


if __name__ == "__main__":
    main()
