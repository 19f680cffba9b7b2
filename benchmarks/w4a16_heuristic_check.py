"""Issue 13: the W4A16 heuristic (shapes no table covers) on shapes it was not fitted to.

    python benchmarks/w4a16_heuristic_check.py --json OUT/w4a16_heuristic_check.json

For each (K, N) and M, one run, the bench_kernels timer: torch bf16 F.linear on the dequantized
weight, `w4a16_linear` with no table entry for the shape on this GPU (the heuristic: on Hopper the
Gluon kernel's tiles) and with the Triton kernels' rule (what any other GPU runs), and where the
heuristic picks the warp-specialized kernel, the split kernel's same tile (the heuristic before
session 15), and where it picks 8-token tiles, the same tile with 16 tokens (the heuristic before
session 19), each checked against the float32 product first. (Session 18's comparison, the tiles
before the products were scaled per tile, is in git history: commit c01c4b2.) Where it picks a 64-token
tile: that tile with the scale on the products, on 64 and 128 rows, split 1, 2 and 4 (session 24's
question: does the 64-token table entries' order carry over to other shapes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from llmc.kernels import device_num_sms
from llmc.kernels.timing import make_l2_flush_buffer, median_time_ms
from llmc.kernels.w4a16_gemm import (
    W4A16Config, dequantize_w4a16, heuristic_w4a16_config, pack_w4a16_for_gpu, w4a16_linear, wgmma_stages)
from w4a16_kind_sweep import parse_shapes  # (benchmarks/ is the script's folder)

# (K, N) of other models than the fitted Llama-3-8B: Llama-2-13B qkv / down, Qwen2.5-7B gate_up, a
# narrow 70B-at-tensor-8 o projection
SHAPES = [(5120, 15360), (13824, 5120), (3584, 37888), (1024, 8192)]
MS = [1, 4, 8, 16, 64, 128, 256, 512, 1024]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--ms", type=int, nargs="+", default=MS)
    parser.add_argument("--shapes", nargs="+", default=None, help="KxN (default: the four other models' shapes)")
    args = parser.parse_args(argv)
    flush = make_l2_flush_buffer()
    num_sms = device_num_sms(torch.device("cuda"))
    rows = []
    shapes = parse_shapes(args.shapes, SHAPES)
    for k, n in shapes:
        levels = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda")
        scales = (torch.rand(n, k // 128, device="cuda") * 0.004 + 0.001).to(torch.bfloat16)
        w4 = pack_w4a16_for_gpu(levels, scales, None)
        dense = dequantize_w4a16(w4, k, 128).to(torch.bfloat16)
        for m in args.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x.float(), dense.float())
            triton_rule = heuristic_w4a16_config(m, k, n, num_sms, wgmma=False)
            runs = {
                "bf16": lambda: F.linear(x, dense),
                "heuristic": lambda: w4a16_linear(x, w4["qweight"], w4["scales"], None, None, 128, table={}),
                "triton_rule": lambda: w4a16_linear(x, w4["qweight"], w4["scales"], None, None, 128,
                                                    table={f"{k}x{n}": [(m, triton_rule, None)]}),
            }
            heuristic = heuristic_w4a16_config(m, k, n, num_sms)
            if heuristic.kind == "wgmma_ws":
                split_tile = W4A16Config("wgmma", heuristic.block_m, heuristic.block_n, heuristic.split_k, 8,
                                         wgmma_stages(heuristic.block_m, heuristic.block_n), True)
                runs["split_kernel"] = lambda: w4a16_linear(x, w4["qweight"], w4["scales"], None, None, 128,
                                                            table={f"{k}x{n}": [(m, split_tile, None)]})
            if heuristic.kind == "wgmma" and heuristic.block_m == 8:
                before = dataclasses.replace(heuristic, block_m=16)  # the 16-token tile of session 18
                runs["before_session19"] = lambda: w4a16_linear(x, w4["qweight"], w4["scales"], None, None, 128,
                                                                table={f"{k}x{n}": [(m, before, None)]})
            if heuristic.kind == "wgmma" and heuristic.block_m == 64:
                for block_n in (64, 128):
                    for split_k in (1, 2, 4):
                        if split_k * 8 > -(-k // 128):
                            continue
                        tile = W4A16Config("wgmma", 64, block_n, split_k, 4, 4, True, scale_acc=True)
                        runs[f"scale_acc_{block_n}_sk{split_k}"] = (
                            lambda tile=tile: w4a16_linear(x, w4["qweight"], w4["scales"], None, None, 128,
                                                           table={f"{k}x{n}": [(m, tile, None)]}))
            times = {}
            for name, fn in runs.items():
                err = float((fn().float() - ref).norm() / ref.norm())
                assert err < 1e-2, f"{k}x{n} M={m} {name}: relative error {err:.3e}"
                times[name] = round(1000 * median_time_ms(fn, flush), 2)
            row = {"K": k, "N": n, "M": m, "times_us": times,
                   "heuristic_config": heuristic.to_dict(),
                   "heuristic_speedup": round(times["bf16"] / times["heuristic"], 3),
                   "triton_rule_speedup": round(times["bf16"] / times["triton_rule"], 3)}
            print(f"{k}x{n} M={m}: bf16 {times['bf16']} us, heuristic {times['heuristic']} us "
                  f"({row['heuristic_speedup']}x, {row['heuristic_config']['kind']}), Triton rule "
                  f"{times['triton_rule']} us ({row['triton_rule_speedup']}x), split kernel "
                  f"{times.get('split_kernel', '-')} us, before session 19 {times.get('before_session19', '-')} us"
                  + "".join(f", {name} {t} us" for name, t in times.items() if name.startswith("scale_acc")),
                  flush=True)
            rows.append(row)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
