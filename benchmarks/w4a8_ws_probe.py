"""W4A8 (int4 weights, per-token FP8 activations, FP8 tensor cores; kernels/w4a8_ws.py) against bf16 and
the W4A16 table, on the GPU.

    python benchmarks/w4a8_ws_probe.py --json OUT.json [--ms 64 256 1024 4096] [--configs 128,1 64,1 128,2]

First the byte order of the conversion (cvt.rn.satfinite.e4m3x2.f16x2's halves) and the kernel
against float64 on small shapes (zero points, bias, M and N tails, split K, per-channel groups): the
reference is the dequantized weight times the dequantized FP8 activations, so only the fp32
accumulation differs. Then, for the Llama-3-8B linear shapes and each M: torch bf16 F.linear, the
W4A16 kernel DEFAULT_W4A16_TABLE picks, FP8 W8A8 (fp8_linear) and W4A8 with each config (token tile,
K splits), its time including the activations' quantization. Same timer as bench_kernels (CUDA-graph
replays, cold L2, medians). Also the error of each against the float64 product with the bf16
activations, which is what W4A8 gives up.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from llmc.kernels.fp8 import MIN_SCALE, fp8_linear, quantize_fp8_per_token
from llmc.kernels.fp8_triton import quantize_fp8_per_token as quantize_permuted
from llmc.kernels.timing import make_l2_flush_buffer, median_time_ms
from llmc.kernels.w4a16_gemm import dequantize_w4a16, pack_w4a16_for_gpu, w4a16_linear
from llmc.kernels.w4a8_ws import launch_w4a8_ws, w4a8_stages

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]


def w4a8(x, params, bias, group_size, block_m, split_k, stages=None):
    x8, xs = quantize_permuted(x, MIN_SCALE, permute=True)
    return launch_w4a8_ws(x8, xs, params["qweight"], params["scales"], params.get("qzeros"), bias, group_size,
                          block_m, split_k, stages or w4a8_stages(block_m), x.dtype)


def reference(x, params, bias, k, group_size):
    """float64: the dequantized weight times the activations as the FP8 kernel sees them."""
    x8, xs = quantize_fp8_per_token(x)
    w = dequantize_w4a16(params, k, group_size).double()
    out = (x8.double() * xs.double()) @ w.t()
    return out + bias.double() if bias is not None else out


def byte_orders() -> dict:
    """The kernel's error for each order the conversion's four bytes could come in (the activations
    permuted on the host): only the order the kernel assumes (0, 2, 1, 3) should be exact."""
    k, n, m = 256, 128, 16
    levels = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda")
    params = pack_w4a16_for_gpu(levels, torch.full((n, 2), 0.01, device="cuda", dtype=torch.bfloat16), None)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    expected = reference(x, params, None, k, 128)
    pos = torch.arange(k, device="cuda")
    errors = {}
    for sigma in ((0, 2, 1, 3), (0, 1, 2, 3), (2, 0, 3, 1), (1, 3, 0, 2), (3, 1, 2, 0)):
        src = (pos // 64) * 64 + 16 * torch.tensor(sigma, device="cuda")[pos % 4] + (pos % 64) // 4
        x8, xs = quantize_fp8_per_token(x[:, src].contiguous())
        got = launch_w4a8_ws(x8, xs, params["qweight"], params["scales"], None, None, 128, 64, 1, 4,
                             torch.bfloat16).double()
        errors[str(sigma)] = ((got - expected).norm() / expected.norm()).item()
    print("byte orders", errors, flush=True)
    return errors


def check_cases() -> list[dict]:
    cases = [  # (K, N, M, group, zero points, bias, block_m, split_k)
        (256, 128, 1, 128, False, False, 64, 1),
        (512, 192, 70, 128, True, True, 64, 1),
        (1024, 256, 300, -1, False, True, 128, 1),
        (768, 320, 129, 256, True, False, 128, 2),
        (4096, 6144, 256, 128, False, False, 128, 1),
        (14336, 4096, 1000, 128, True, True, 128, 2),
    ]
    results = []
    for k, n, m, group, has_zeros, has_bias, block_m, split_k in cases:
        levels = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda")
        groups = 1 if group == -1 else k // group
        scales = (torch.rand(n, groups, device="cuda") * 0.004 + 0.001).to(torch.bfloat16)
        zeros = torch.randint(0, 16, (n, groups), dtype=torch.int32, device="cuda") if has_zeros else None
        params = pack_w4a16_for_gpu(levels, scales, zeros)
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if has_bias else None
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        got = w4a8(x, params, bias, group, block_m, split_k).double()
        expected = reference(x, params, bias, k, group)
        err = ((got - expected).norm() / expected.norm()).item()
        results.append({"k": k, "n": n, "m": m, "group": group, "zeros": has_zeros, "bias": has_bias,
                        "block_m": block_m, "split_k": split_k, "rel_err": err, "ok": err < 5e-3})
        print("check", results[-1], flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    parser.add_argument("--ms", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 4096])
    parser.add_argument("--configs", nargs="+", default=["64,1", "128,1", "128,2"],
                        help="token tile,K splits[,stages]")
    args = parser.parse_args()
    torch.manual_seed(0)
    report = {"device": torch.cuda.get_device_name(), "byte_orders": byte_orders(), "checks": check_cases(),
              "timings": []}
    flush = make_l2_flush_buffer(torch.device("cuda"))
    for k, n in SHAPES:
        levels = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda")
        scales = (torch.rand(n, k // 128, device="cuda") * 0.004 + 0.001).to(torch.bfloat16)
        params = pack_w4a16_for_gpu(levels, scales, None)
        dense = dequantize_w4a16(params, k, 128).to(torch.bfloat16)
        w8, w8_scale = quantize_fp8_per_token(dense)
        for m in args.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            exact = x.double() @ dequantize_w4a16(params, k, 128).double().t()
            row = {"k": k, "n": n, "m": m}
            runs = {
                "bf16": lambda: F.linear(x, dense),
                "w4a16": lambda: w4a16_linear(x, params["qweight"], params["scales"], None, None, 128),
                "fp8_w8a8": lambda: fp8_linear(x, w8, w8_scale.squeeze(-1), None),
            }
            for spec in args.configs:
                block_m, split_k, *stages = (int(v) for v in spec.split(","))
                runs[f"w4a8_{spec}"] = (lambda b=block_m, s=split_k, st=stages: w4a8(
                    x, params, None, 128, b, s, st[0] if st else None))
            for name, fn in runs.items():
                try:
                    out = fn().double()
                    row[name + "_err"] = ((out - exact).norm() / exact.norm()).item()
                    row[name + "_us"] = median_time_ms(fn, flush) * 1000
                except Exception as exc:  # a config that does not fit: recorded, not fatal
                    row[name + "_error"] = repr(exc)[:300]
            best = min((v, key) for key, v in row.items() if key.startswith("w4a8") and key.endswith("_us"))
            row["best_w4a8"] = best[1]
            print(f"{k}x{n} M={m}: bf16 {row['bf16_us']:.1f} µs, w4a16 {row['w4a16_us']:.1f} "
                  f"({row['bf16_us'] / row['w4a16_us']:.2f}x), fp8 {row.get('fp8_w8a8_us', float('nan')):.1f}, "
                  f"w4a8 best {best[0]:.1f} ({row['bf16_us'] / best[0]:.2f}x, {best[1]}); "
                  f"err w4a16 {row['w4a16_err']:.2e} w4a8 {row[best[1].replace('_us', '_err')]:.2e}", flush=True)
            report["timings"].append(row)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
