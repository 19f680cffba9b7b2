"""Issue 13, large M: is W4A8 through cuBLAS's block-scaled FP8 GEMM faster than bf16?

    python benchmarks/w4a8_probe.py --json OUT/w4a8_probe.json

For the Llama-3-8B linear shapes (K × N) and M tokens, in one run, with the bench_kernels timer
(CUDA-graph replays, cold L2, medians; kernels/timing.py):
- bf16: torch F.linear on the dequantized weight (the baseline of every ratio);
- w4a16: today's W4A16 dispatch (kernels/w4a16_gemm.w4a16_linear, the default table);
- fp8: FP8 W8A8 (per-channel weight scales, per-token activations; kernels/fp8.fp8_linear);
- w4a8 parts and whole: the int4 levels unpacked to E4M3 (level - zero is an integer in [-15, 15],
  exact in E4M3), activations quantized to E4M3 per 1x128 block, then torch._scaled_mm with
  1x128 x 1x128 block scales (the weight's group-128 scales are its block scales): "unpack",
  "actq", "gemm" alone, and "w4a8" the three in one graph.
Each w4a8 result is also checked against float64 on the dequantized weight (relative Frobenius error).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import GROUP_SIZE, SHAPES, make_weights  # noqa: E402

from llmc.kernels.fp8 import fp8_linear  # noqa: E402
from llmc.kernels.timing import make_l2_flush_buffer, median_time_ms  # noqa: E402
from llmc.kernels.w4a16_gemm import w4a16_linear  # noqa: E402


@triton.jit
def _unpack_fp8_kernel(qw_ptr, w_ptr, N, K, BLOCK_N: tl.constexpr):
    """Symmetric gpu layout → E4M3 levels - 8, [N, K] row-major, one 128-column tile per program."""
    t, pid_n = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    w = tl.load(qw_ptr + (t * 16 + tl.arange(0, 16))[:, None] * N + offs_n[None, :], mask=n_mask[None, :], other=0)
    levels = (w[None, :, :] >> (4 * tl.arange(0, 8))[:, None, None]) & 0xF
    levels = tl.reshape(levels, (128, BLOCK_N)) - 8
    offs_k = t * 128 + tl.arange(0, 128)
    out = tl.trans(levels.to(tl.float32).to(w_ptr.dtype.element_ty))
    tl.store(w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :], out,
             mask=n_mask[:, None] & (offs_k < K)[None, :])


@triton.jit
def _quantize_1x128_kernel(x_ptr, out_ptr, scale_ptr, M, K, stride_x):
    """x [M, K] → E4M3 [M, K] and scales [K / 128, M] (so scale.t() is [M, K/128], M-major)."""
    m, g = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs = g * 128 + tl.arange(0, 128)
    x = tl.load(x_ptr + m * stride_x + offs).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / 448.0, 1e-30)
    tl.store(scale_ptr + g * M + m, scale)
    tl.store(out_ptr + m * K + offs, tl.clamp(x / scale, -448.0, 448.0).to(out_ptr.dtype.element_ty))


def unpack_fp8(qweight, k):
    n = qweight.shape[1]
    w = torch.empty(n, k, device=qweight.device, dtype=torch.float8_e4m3fn)
    _unpack_fp8_kernel[(qweight.shape[0] // 16, triton.cdiv(n, 64))](qweight, w, n, k, BLOCK_N=64, num_warps=4)
    return w


def quantize_1x128(x):
    m, k = x.shape
    out = torch.empty(m, k, device=x.device, dtype=torch.float8_e4m3fn)
    scale = torch.empty(k // 128, m, device=x.device, dtype=torch.float32)
    _quantize_1x128_kernel[(m, k // 128)](x, out, scale, m, k, x.stride(0), num_warps=1)
    return out, scale.t()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--ms", default="16,64,256,1024,4096")
    args = parser.parse_args(argv)
    flush = make_l2_flush_buffer()
    rows = []
    for k, n in SHAPES:
        weights = make_weights(k, n)
        dense, w4, fp8 = weights["dense"], weights["w4"], weights["fp8"]
        w_scale = w4["scales"].float().contiguous()  # [K / 128, N]: the 1x128 block scales of w.T
        w_fp8 = unpack_fp8(w4["qweight"], k)
        exact = dense.double()
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            x_fp8, x_scale = quantize_1x128(x)

            def w4a8():
                a, sa = quantize_1x128(x)
                return torch._scaled_mm(a, unpack_fp8(w4["qweight"], k).t(), sa, w_scale, out_dtype=torch.bfloat16)

            runs = {
                "bf16": lambda: F.linear(x, dense),
                "w4a16": lambda: w4a16_linear(x, w4["qweight"], w4["scales"], None, None, GROUP_SIZE),
                "fp8": lambda: fp8_linear(x, fp8["weight"], fp8["weight_scale"], None),
                "unpack": lambda: unpack_fp8(w4["qweight"], k),
                "actq": lambda: quantize_1x128(x),
                "gemm": lambda: torch._scaled_mm(x_fp8, w_fp8.t(), x_scale, w_scale, out_dtype=torch.bfloat16),
                "w4a8": w4a8,
            }
            row = {"K": k, "N": n, "M": m}
            for name, fn in runs.items():
                try:
                    row[f"{name}_us"] = round(1000 * median_time_ms(fn, flush), 2)
                except Exception as exc:  # noqa: BLE001 - a probe: record why and go on
                    row[f"{name}_error"] = str(exc)[:300]
            try:
                ref = x.double() @ exact.t()
                got = w4a8().double()
                row["w4a8_rel_err"] = float((got - ref).norm() / ref.norm())
                row["bf16_rel_err"] = float((F.linear(x, dense).double() - ref).norm() / ref.norm())
            except Exception as exc:  # noqa: BLE001
                row["check_error"] = str(exc)[:300]
            base = row.get("bf16_us")
            speedups = {name: round(base / row[f"{name}_us"], 3) for name in ("w4a16", "fp8", "w4a8")
                        if base and f"{name}_us" in row}
            row["speedup_vs_bf16"] = speedups
            print(json.dumps(row), flush=True)
            rows.append(row)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                     "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
