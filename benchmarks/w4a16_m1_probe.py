"""Issue 13: what bounds the one-token W4A16 GEMV (kind "wgmma", per-tile order), in one device run.

    python benchmarks/w4a16_m1_probe.py --json OUT/m1_probe.json

For each Llama-3-8B linear at M = 1 (and 16), with the bench_kernels timer (CUDA-graph replays, cold
L2, median, the fixed ~4 µs of one replay included), the Gluon kernel's per-tile order in variants
switched by its PROBE constexpr (probe-only: wrong results, except 0):
  full       PROBE 0, the kernel as it runs
  raw        PROBE 1, the packed words fed to the wgmmas as they are (no int4 conversion)
  pipeline   PROBE 3, only the TMA ring: wait for each tile, refill its stage (no shared-memory
             load, no conversion, no MMA)
beside torch bf16 and a Triton kernel that only reads the packed weight and its scales.
Tiles: the table's (block_n, split, warps) with per_tile forced on, and `--stages` ring depths.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from llmc.kernels import device_num_sms
from llmc.kernels.timing import make_l2_flush_buffer, median_time_ms
from llmc.kernels.w4a16_gemm import dequantize_w4a16, pack_w4a16_for_gpu, run_w4a16_config, select_w4a16_config
from llmc.kernels.w4a16_gluon import _w4a16_wgmma_kernel, launch_tiled
from w4a16_small_m_probe import _read_kernel  # (benchmarks/ is the script's folder)

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
# per-tile order variants: name → (PROBE, SCALE_ACC)
VARIANTS = {"full": (0, False), "scale_acc": (0, True), "raw": (1, False), "pipeline": (3, False)}


def parse_tile(spec: str) -> tuple[int, int, int, int]:
    """block_n,split_k,num_warps,stages"""
    return tuple(int(v) for v in spec.split(","))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--tiles", nargs="*", default=[], metavar="KxN:block_n,split,warps,stages",
                        help="extra per-tile configs for one shape (the table's tile is always timed)")
    args = parser.parse_args(argv)
    flush = make_l2_flush_buffer()
    num_sms = device_num_sms(torch.device("cuda"))
    block, programs = 2048, 4 * num_sms
    sink = torch.empty(programs * block, dtype=torch.int32, device="cuda")
    rows = []
    for k, n in SHAPES:
        levels = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda")
        scales = (torch.rand(n, k // 128, device="cuda") * 0.004 + 0.001).to(torch.bfloat16)
        w4 = pack_w4a16_for_gpu(levels, scales, None)
        dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        words = torch.cat([w4["qweight"].flatten(), w4["scales"].flatten().view(torch.int32)])
        row = {"shape": f"{k}x{n}", "bytes": words.numel() * 4,
               "read_us": 1000 * median_time_ms(
                   lambda: _read_kernel[(programs,)](words, sink, words.numel(), BLOCK=block, num_warps=8), flush)}
        for m in args.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            config = select_w4a16_config(m, k, n, None, num_sms)
            cell = {"table": config.to_dict(), "bf16_us": 1000 * median_time_ms(lambda: F.linear(x, dense), flush)}
            expected = F.linear(x.float(), dequantize_w4a16(w4, k, 128).float())
            table_out = run_w4a16_config(x, w4["qweight"], w4["scales"], None, None, 128, config)
            cell["table_us"] = 1000 * median_time_ms(
                lambda: run_w4a16_config(x, w4["qweight"], w4["scales"], None, None, 128, config), flush)
            cell["table_rel_err"] = ((table_out.float() - expected).norm() / expected.norm()).item()
            tiles = [(config.block_n, config.split_k, config.num_warps, config.num_stages)] if config.kind == "wgmma" else []
            tiles += [parse_tile(t.split(":")[1]) for t in args.tiles if t.split(":")[0] == f"{k}x{n}"]
            for block_n, split_k, num_warps, stages in tiles:
                for name in args.variants:
                    probe, scale_acc = VARIANTS[name]
                    run = lambda: launch_tiled(
                        _w4a16_wgmma_kernel, x, w4["qweight"], w4["scales"], None, None, 128, config.block_m,
                        block_n, split_k, sum_in_kernel=True, STAGES=stages, PER_TILE=True, PROBE=probe,
                        SCALE_ACC=scale_acc, num_warps=num_warps)
                    key = f"{name}_n{block_n}_k{split_k}_w{num_warps}_s{stages}"
                    cell[f"{key}_us"] = 1000 * median_time_ms(run, flush)
                    if probe == 0:
                        cell[f"{key}_rel_err"] = ((run().float() - expected).norm() / expected.norm()).item()
            row[f"m{m}"] = cell
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
