"""Issue 13: the Gluon W4A16 kernels under each value of one module-level switch, in one device run:
w4a16_gluon.LIVE_OPERANDS 0 / 1 (session 24: the operands of a tile's in-flight wgmmas read once more
after the wait, so that ptxas converts the next tile's operands into registers of their own while the
wgmmas run), w4a16_ws.TMA_STORE 0 / 1 (session 25: the tiles out by TMA stores); session 25's w4a16_ws.PINGPONG 0 / 1 (the warpgroups taking turns at every tile: check out
commit c1b60a1 (the turn passed after the wait) or 0584846 (at issue), benchmarks/RESULTS.md).

    python benchmarks/w4a16_switch_probe.py --json OUT.json [--switch w4a16_ws.PINGPONG --values 0 1] \
        [--ms 128 256 1024 4096] [--configs wgmma_ws,128,128,1,4,5,1 ...] [--rounds 3]

Per Llama-3-8B linear and M: torch bf16 F.linear, then the table's config (or each config named, in
w4a16_kind_sweep's notation), timed with the bench_kernels timer (CUDA-graph replays, cold L2, median),
the values alternating (the best of the rounds' medians is reported); rel_err against the float64
product of the dequantized weight.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from llmc.kernels import device_num_sms, w4a16_gluon, w4a16_ws
from llmc.kernels.timing import make_l2_flush_buffer, median_time_ms
from llmc.kernels.w4a16_gemm import dequantize_w4a16, pack_w4a16_for_gpu, run_w4a16_config, select_w4a16_config
from w4a16_kind_sweep import SHAPES, parse_config, parse_shapes  # (benchmarks/ is the script's folder)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--ms", type=int, nargs="+", default=[128, 256, 512, 1024, 4096])
    parser.add_argument("--configs", nargs="+", default=None)
    parser.add_argument("--shapes", nargs="+", default=None, help="KxN, e.g. 4096x6144 (default: all four)")
    parser.add_argument("--zeros", action="store_true", help="asymmetric weights (zero points)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--switch", default="w4a16_gluon.LIVE_OPERANDS", help="MODULE.NAME (w4a16_gluon or w4a16_ws)")
    parser.add_argument("--values", type=int, nargs="+", default=[0, 1], help="the first is the baseline")
    args = parser.parse_args(argv)
    flush = make_l2_flush_buffer()
    num_sms = device_num_sms(torch.device("cuda"))
    torch.manual_seed(0)
    shapes = parse_shapes(args.shapes, SHAPES)
    rows = []
    module_name, name = args.switch.split(".")
    module = {"w4a16_gluon": w4a16_gluon, "w4a16_ws": w4a16_ws}[module_name]
    default = getattr(module, name)
    values = args.values
    for k, n in shapes:
        levels = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda")
        scales = (torch.rand(n, k // 128, device="cuda") * 0.004 + 0.001).to(torch.bfloat16)
        z = torch.randint(0, 16, (n, k // 128), dtype=torch.int32, device="cuda") if args.zeros else None
        w4 = pack_w4a16_for_gpu(levels, scales, z)
        dense64 = dequantize_w4a16(w4, k, 128).double()
        dense = dense64.to(torch.bfloat16)
        for m in args.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            expected = x.double() @ dense64.T
            bf16_us = 1000 * median_time_ms(lambda: F.linear(x, dense), flush)
            configs = [parse_config(c) for c in args.configs] if args.configs else [select_w4a16_config(m, k, n, None, num_sms)]
            for config in configs:
                if config.kind not in ("wgmma", "wgmma_ws"):
                    continue
                run = lambda: run_w4a16_config(x, w4["qweight"], w4["scales"], w4.get("qzeros"), None, 128, config)
                errs, times = {}, {v: [] for v in values}
                for v in values:
                    setattr(module, name, v)
                    errs[v] = ((run().double() - expected).norm() / expected.norm()).item()
                for _ in range(args.rounds):
                    for v in values:
                        setattr(module, name, v)
                        times[v].append(1000 * median_time_ms(run, flush))
                setattr(module, name, default)
                best = {v: min(times[v]) for v in values}
                rows.append({"shape": f"{k}x{n}", "m": m, "zeros": args.zeros, "config": config.to_dict(),
                             "switch": args.switch, "bf16_us": bf16_us, "us": {str(v): times[v] for v in values},
                             "rel_err": {str(v): errs[v] for v in values}})
                cells = "  ".join(f"{v}: {best[v]:.2f} ({bf16_us / best[v]:.2f}x, {best[v] / best[values[0]]:.3f}, "
                                  f"err {errs[v]:.1e})" for v in values)
                print(f"{k}x{n} m={m} {config.kind},{config.block_m},{config.block_n},{config.split_k},"
                      f"{config.num_warps},{config.num_stages},{int(config.is_stacked)},{int(config.scale_acc)}: "
                      f"bf16 {bf16_us:.2f}  {cells}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "switch": args.switch, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
