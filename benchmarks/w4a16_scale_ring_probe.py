"""Issue 13: the few-token Gluon W4A16 GEMV with its group scales (and zero points) in the TMA ring or
loaded from global memory one tile ahead, in one device run.

    python benchmarks/w4a16_scale_ring_probe.py --json OUT/scale_ring.json [--ms 1 8 16] [--rounds 3]

The table's config (kind wgmma, per tile, scale_acc) per Llama-3-8B linear and M, symmetric and with
zero points, timed with the bench_kernels timer (CUDA-graph replays, cold L2, median) in each variant,
alternating: "off" (w4a16_gluon.SCALE_RING False: scales and zero points by global loads), "scales"
(SCALE_RING, ZERO_RING False: the zero points still by global loads; with zero points only) and "on"
(both in the ring); rel_err is against the float64 product of the dequantized weight.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from llmc.kernels import device_num_sms, w4a16_gluon
from llmc.kernels.timing import make_l2_flush_buffer, median_time_ms
from llmc.kernels.w4a16_gemm import dequantize_w4a16, pack_w4a16_for_gpu, run_w4a16_config, select_w4a16_config

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
VARIANTS = {"off": (False, False), "scales": (True, False), "on": (True, True)}  # (SCALE_RING, ZERO_RING)


def _set(variant: str) -> None:
    w4a16_gluon.SCALE_RING, w4a16_gluon.ZERO_RING = VARIANTS[variant]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    flush = make_l2_flush_buffer()
    num_sms = device_num_sms(torch.device("cuda"))
    torch.manual_seed(0)
    rows = []
    for k, n in SHAPES:
        levels = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda")
        scales = (torch.rand(n, k // 128, device="cuda") * 0.004 + 0.001).to(torch.bfloat16)
        for zeros in (False, True):
            z = torch.randint(0, 16, (n, k // 128), dtype=torch.int32, device="cuda") if zeros else None
            w4 = pack_w4a16_for_gpu(levels, scales, z)
            dense = dequantize_w4a16(w4, k, 128).double()
            for m in args.ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                config = select_w4a16_config(m, k, n, None, num_sms)
                if not (config.kind == "wgmma" and config.is_stacked and config.scale_acc):
                    continue
                run = lambda: run_w4a16_config(x, w4["qweight"], w4["scales"], w4.get("qzeros"), None, 128, config)
                expected = x.double() @ dense.T
                variants = list(VARIANTS) if zeros else ["off", "on"]
                errs, times = {}, {variant: [] for variant in variants}
                for variant in variants:
                    _set(variant)
                    errs[variant] = ((run().double() - expected).norm() / expected.norm()).item()
                for _ in range(args.rounds):
                    for variant in variants:
                        _set(variant)
                        times[variant].append(1000 * median_time_ms(run, flush))
                _set("on")
                row = {"shape": f"{k}x{n}", "zeros": zeros, "m": m, "config": config.to_dict(), "rel_err": errs,
                       "us": times}
                rows.append(row)
                print(f"{k}x{n} zeros={zeros} m={m}: " + "  ".join(
                    f"{variant}: {min(times[variant]):.2f} us (err {errs[variant]:.1e})" for variant in variants),
                    flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
