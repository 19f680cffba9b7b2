"""The warp-specialized W4A16 kernel with its two consumer warpgroups in lock-step and staggered, same run.

    python benchmarks/w4a16_ws_pingpong.py --json OUT.json [--ms 64 256 1024]

In lock-step both warpgroups issue a tile's wgmmas together and wait for them together, so the tensor
cores' queue empties at every tile. Staggered (w4a16_ws.PINGPONG), the second warpgroup issues its first
tile once the first warpgroup's is queued; from then on each warpgroup's wgmmas queue behind the
other's, and one converts and waits while the other multiplies. For the Llama-3-8B shapes and each M:
torch bf16, and every warp-specialized tuner candidate both ways (checked against dequantize + F.linear
first; the sweep's timer: CUDA-graph replays, cold L2, medians).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from w4a16_kind_sweep import SHAPES

from llmc.kernels import device_num_sms, w4a16_ws
from llmc.kernels.timing import make_l2_flush_buffer, median_time_ms
from llmc.kernels.w4a16_gemm import pack_w4a16_for_gpu, run_w4a16_config
from llmc.kernels.w4a16_triton import launch_w4a16_dequantize
from llmc.kernels.w4a16_tune import candidate_configs, check_and_time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    parser.add_argument("--ms", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 4096])
    args = parser.parse_args()
    torch.manual_seed(0)
    num_sms = device_num_sms(torch.device("cuda"))
    flush = make_l2_flush_buffer(torch.device("cuda"))
    records, rows = [], []
    for k, n in SHAPES:
        levels = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda")
        scales = (torch.rand(n, k // 128, device="cuda") * 0.004 + 0.001).to(torch.bfloat16)
        params = pack_w4a16_for_gpu(levels, scales, None)
        qweight, qscales = params["qweight"], params["scales"]
        dense = launch_w4a16_dequantize(qweight, qscales, None, k, 128).to(torch.bfloat16)
        for m in args.ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            expected = F.linear(x, dense).float()
            bf16_us = median_time_ms(lambda: F.linear(x, dense), flush) * 1000
            best = {}
            for config in [c for c in candidate_configs(m, k, n, num_sms, wgmma=True) if c.kind == "wgmma_ws"]:
                for pingpong in (False, True):
                    w4a16_ws.PINGPONG = pingpong
                    run = lambda c=config: run_w4a16_config(x, qweight, qscales, None, None, 128, c)  # noqa: E731
                    result = check_and_time(run, expected, flush, f"{k}x{n} m={m} {config} pingpong={pingpong}")
                    if result is None:
                        continue
                    us = result[0] * 1000
                    records.append({"K": k, "N": n, "M": m, "config": config.to_dict(), "pingpong": pingpong,
                                    "us": round(us, 2), "error": result[1]})
                    if pingpong not in best or us < best[pingpong][0]:
                        best[pingpong] = (us, config)
            row = {"K": k, "N": n, "M": m, "bf16_us": round(bf16_us, 2)}
            for pingpong, (us, config) in best.items():
                row["pingpong" if pingpong else "lockstep"] = {"us": round(us, 2), "config": config.to_dict()}
            rows.append(row)
            lock, pong = best.get(False, (0, None))[0], best.get(True, (0, None))[0]
            print(f"{k}x{n} M={m}: bf16 {bf16_us:.1f} us | lock-step {lock:.1f} ({bf16_us / lock if lock else 0:.2f}x) "
                  f"| staggered {pong:.1f} ({bf16_us / pong if pong else 0:.2f}x) {best.get(True, (0, None))[1]}",
                  flush=True)
    w4a16_ws.PINGPONG = True
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "candidates": records}, f, indent=1)


if __name__ == "__main__":
    main()
