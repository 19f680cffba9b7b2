"""w8a8-fp8-block on the GPU: the format's linear (group quantization + the Triton kernel) beside cuBLAS bf16 and the
per-channel w8a8-fp8 linear, on Llama-3-8B's four shapes at M = 1 ... 4096, bench_kernels' timer (CUDA-graph replays,
cold L2, median); a tile sweep of the Triton kernel; and which of torch's block-scaled cuBLAS products
(F.scaled_mm with BlockWise1x128 / BlockWise128x128 scales) run on this GPU and how fast.

    python -P benchmarks/bench_fp8_block.py --json OUT.json [--sweep] [--ms 1 16 256]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from llmc.kernels import fp8 as fp8_kernels
from llmc.kernels.fp8 import expand_group_scales, fp8_block_matmul, quantize_fp8_per_token_group, select_fp8_block_kernel
from llmc.kernels.timing import make_l2_flush_buffer, median_time_ms
from llmc.quant.formats import Fp8BlockFormat, Fp8Format
from llmc.quant.fp8 import quantize_fp8_weight, quantize_fp8_weight_block

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # K x N: qkv, o, gate_up, down
MS = [1, 4, 16, 64, 256, 1024, 4096]


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref.double()).norm() / ref.double().norm())


def scaled_mm_variants(xq, xs, w, ws_rows, n, k):
    """torch's block-scaled products of the same operands, by name: (callable, or the error it raised)."""
    compact = ws_rows[::128].contiguous()  # [N/128, K/128]: the rows of a block repeat its scale
    xs_outer = xs.t().contiguous().t()  # [M, K/128], M contiguous ("outer-dim-major")
    variants = {}
    ws_rows = ws_rows.t().contiguous().t()  # (the layout the 1 x 128 weight scales take)
    if hasattr(F, "scaled_mm"):
        st = F.ScalingType
        variants["F.scaled_mm 1x128 / 128x128 [N/128, K/128]"] = lambda: F.scaled_mm(
            xq, w.t(), xs_outer, st.BlockWise1x128, compact, st.BlockWise128x128, output_dtype=torch.bfloat16)
        variants["F.scaled_mm 1x128 / 128x128 [K/128, N/128]"] = lambda: F.scaled_mm(
            xq, w.t(), xs_outer, st.BlockWise1x128, compact.t(), st.BlockWise128x128, output_dtype=torch.bfloat16)
        variants["F.scaled_mm 1x128 / 1x128 [N, K/128]"] = lambda: F.scaled_mm(
            xq, w.t(), xs_outer, st.BlockWise1x128, ws_rows, st.BlockWise1x128,
            output_dtype=torch.bfloat16)
    variants["torch._scaled_mm [M, K/128] / [K/128, N/128]"] = lambda: torch._scaled_mm(
        xq, w.t(), scale_a=xs_outer, scale_b=compact.t(), out_dtype=torch.bfloat16)
    return variants


def tile_candidates(m: int) -> list[dict]:
    if m <= 16:
        grid = itertools.product([16], [32, 64, 128], [128], [1, 2, 4], [4], [3, 4])
    elif m <= 64:
        grid = itertools.product([32, 64], [64, 128], [128], [1, 2], [4, 8], [3])
    else:
        grid = itertools.product([64, 128], [64, 128], [64, 128], [1], [4, 8], [3, 4])
    return [dict(block_m=a, block_n=b, block_k=c, split_k=d, num_warps=e, num_stages=f) for a, b, c, d, e, f in grid]


def bench_shape(k: int, n: int, ms: list[int], flush, sweep: bool) -> list[dict]:
    from llmc.kernels.fp8_triton import fp8_linear_small_m

    torch.manual_seed(0)
    dense = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
    block_fmt, channel_fmt = Fp8BlockFormat(torch.bfloat16), Fp8Format(torch.bfloat16)
    block = block_fmt.pack(quantize_fp8_weight_block(dense.float(), (128, 128)))
    block |= block_fmt.derived_params(block)  # the 128 x 128 scales cuBLAS reads, as a loaded model derives them
    channel = channel_fmt.pack(quantize_fp8_weight(dense.float()))
    w_fp64 = block["weight"].double() * expand_group_scales(block["weight_scale"].double(), 128, k)
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        xq, xs = quantize_fp8_per_token_group(x, 128)
        exact = (xq.double() * expand_group_scales(xs.double(), 128, k)) @ w_fp64.T  # the operands' product
        runs = {"bf16": lambda: F.linear(x, dense),
                "fp8_channel": lambda: channel_fmt.apply(x, channel, None),
                "fp8_block": lambda: block_fmt.apply(x, block, None),
                "fp8_block_triton_only": lambda: fp8_block_matmul(xq, xs, block["weight"], block["weight_scale"], 128,
                                                                  None, torch.bfloat16),
                "group_quant_only": lambda: quantize_fp8_per_token_group(x, 128)}
        row = {"K": k, "N": n, "M": m, "block_tiles": select_fp8_block_kernel(m, k, n), "us": {}, "rel_err": {}}
        for name, fn in runs.items():
            row["us"][name] = round(median_time_ms(fn, flush) * 1000, 2)
        fp8_kernels.BLOCK_QUANT_PDL = False  # the group quantization launched without PDL, the GEMM as always
        row["us"]["fp8_block_quant_without_pdl"] = round(median_time_ms(runs["fp8_block"], flush) * 1000, 2)
        fp8_kernels.BLOCK_QUANT_PDL = None
        ref = runs["bf16"]().float()
        for name in ("fp8_channel", "fp8_block"):
            row["rel_err"][name] = round(rel_err(runs[name](), ref), 5)
        row["rel_err"]["fp8_block_triton_vs_fp64"] = rel_err(runs["fp8_block_triton_only"](), exact)
        for name, fn in scaled_mm_variants(xq, xs, block["weight"], block["weight_scale"], n, k).items():
            try:
                err = rel_err(fn(), exact)
                row["us"][name] = round(median_time_ms(fn, flush) * 1000, 2) if err < 1e-2 else None
                row["rel_err"][name] = err
            except Exception as e:  # noqa: BLE001 - recorded: which variants this torch/GPU runs
                row["rel_err"][name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        if sweep:
            best = None
            for tiles in tile_candidates(m):
                try:
                    fn = lambda t=tiles: fp8_linear_small_m(xq, xs, block["weight"], block["weight_scale"], None,
                                                            torch.bfloat16, group_size=128, **t)
                    if rel_err(fn(), exact) > 1e-2:
                        continue
                    us = median_time_ms(fn, flush) * 1000
                except Exception:  # noqa: BLE001 - tiles that do not compile (shared memory) are skipped
                    continue
                if best is None or us < best[0]:
                    best = (round(us, 2), tiles)
            row["sweep_best"] = best
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--ms", type=int, nargs="+", default=MS)
    parser.add_argument("--sweep", action="store_true", help="also time a grid of the Triton kernel's tiles")
    args = parser.parse_args()
    flush = make_l2_flush_buffer()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for k, n in SHAPES:
        result["rows"] += bench_shape(k, n, args.ms, flush, args.sweep)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print("| K×N | M | bf16 µs | fp8 channel ×bf16 | fp8 block ×bf16 | block ÷ channel | block ÷ channel, quantization "
          "without PDL | best scaled_mm µs | sweep best µs |")
    for r in result["rows"]:
        us = r["us"]
        sm = [v for key, v in us.items() if "scaled_mm" in key and v]
        print(f"| {r['K']}×{r['N']} | {r['M']} | {us['bf16']} | {us['bf16'] / us['fp8_channel']:.2f} | "
              f"{us['bf16'] / us['fp8_block']:.2f} | {us['fp8_channel'] / us['fp8_block']:.2f} | "
              f"{us['fp8_channel'] / us['fp8_block_quant_without_pdl']:.2f} | "
              f"{min(sm) if sm else '-'} | {r.get('sweep_best', ['-'])[0]} |")


if __name__ == "__main__":
    main()
