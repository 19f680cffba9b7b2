"""Issue 13: the few-token Gluon W4A16 GEMV with and without XSUM, in one device run.

    python benchmarks/w4a16_xsum_probe.py --json OUT/xsum_probe.json [--ms 1 4 8 16] [--rounds 3]

XSUM: the weight operand is MAGIC + level (prmt, shift, lop3: no subtract per weight pair), and each
tile's products lose (MAGIC + zero) · Σx before the scale, with Σx (the activations' sums over each
128-column K tile, [M, K / 128] fp32) computed outside the kernel. For each Llama-3-8B linear and M,
the table's config (kind wgmma, per tile, scale_acc) is timed both ways in alternation, with the
bench_kernels timer (CUDA-graph replays, cold L2, median), symmetric and with zero points; rel_err
is against the float64 product of the dequantized weight; `xsum_torch_us` times torch making Σx.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from llmc.kernels import device_num_sms
from llmc.kernels.timing import make_l2_flush_buffer, median_time_ms
from llmc.kernels.w4a16_gemm import dequantize_w4a16, pack_w4a16_for_gpu, select_w4a16_config
from llmc.kernels.w4a16_gluon import launch_w4a16_wgmma

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]


def tile_sums(x: torch.Tensor) -> torch.Tensor:
    return x.float().view(x.shape[0], -1, 128).sum(-1).contiguous()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 4, 8, 16])
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
            qz = w4.get("qzeros")
            dense = dequantize_w4a16(w4, k, 128).double()
            for m in args.ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                config = select_w4a16_config(m, k, n, None, num_sms)
                if not (config.kind == "wgmma" and config.is_stacked and config.scale_acc):
                    continue
                xsum = tile_sums(x)

                def run(with_xsum: bool):
                    return launch_w4a16_wgmma(x, w4["qweight"], w4["scales"], qz, None, 128, config.block_m,
                                              config.block_n, config.split_k, config.num_warps, config.num_stages,
                                              True, True, xsum=xsum if with_xsum else None)

                expected = x.double() @ dense.T
                errs = {name: ((run(flag).double() - expected).norm() / expected.norm()).item()
                        for name, flag in (("plain", False), ("xsum", True))}
                times = {"plain": [], "xsum": []}
                for _ in range(args.rounds):
                    for name, flag in (("plain", False), ("xsum", True)):
                        times[name].append(1000 * median_time_ms(lambda: run(flag), flush))
                row = {"shape": f"{k}x{n}", "zeros": zeros, "m": m, "config": config.to_dict(),
                       "rel_err": errs, "us": times,
                       "ratio": min(times["plain"]) / min(times["xsum"]),
                       "xsum_torch_us": 1000 * median_time_ms(lambda: tile_sums(x), flush)}
                rows.append(row)
                print(f"{k}x{n} zeros={zeros} m={m}: plain {min(times['plain']):.2f} xsum {min(times['xsum']):.2f} "
                      f"us ({row['ratio']:.3f}x) err {errs['plain']:.2e}/{errs['xsum']:.2e} "
                      f"torch-sum {row['xsum_torch_us']:.2f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
