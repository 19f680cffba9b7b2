"""Sweep of the many-token W4A16 kernel (kernels/w4a16_mma_triton.py) on the GPU, one run: for the
Llama-3-8B linear shapes and M >= 64, torch bf16 F.linear (cuBLAS), the dispatch as it stands
(w4a16_linear with the default table), W8A8 FP8 (kernels/fp8.fp8_linear), and every candidate tile of
the mma kernel with bf16 operands (W4A16) and with FP8 activations (W4A8). CUDA-graph replays, cold
L2, medians (kernels/timing.py). Prints the best config per (shape, M) and writes --json.

    python benchmarks/w4_mma_sweep.py --json OUT/w4-mma-sweep.json [--ms 64 256] [--quick]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from llmc.kernels.fp8 import fp8_linear
from llmc.kernels.timing import make_l2_flush_buffer, median_time_ms
from llmc.kernels.w4a16_gemm import dequantize_w4a16, pack_w4a16_for_gpu, w4a16_linear
from llmc.kernels.w4a16_mma_triton import launch_w4a16_mma

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # (K, N): qkv, o, gate_up, down
MS = [64, 128, 256, 512, 1024, 4096]
GROUP_SIZE = 128
# (block_m, block_n, group_m, num_warps, num_stages): no register spills for sm_90 (ptxas -v)
CANDIDATES = {
    "cvt": [(64, 128, 8, 4, 3), (128, 128, 8, 8, 2), (128, 128, 8, 8, 3), (128, 64, 8, 4, 3), (256, 128, 8, 8, 2),
            (64, 64, 8, 4, 4), (128, 256, 8, 8, 2)],
    "mma": [(64, 128, 8, 4, 3), (64, 128, 8, 4, 4), (128, 128, 8, 8, 2), (128, 128, 8, 8, 3), (128, 128, 8, 8, 4),
            (128, 64, 8, 4, 3), (256, 128, 8, 8, 2), (64, 64, 8, 4, 4), (64, 256, 8, 8, 3)],
    "w4a8": [(64, 128, 8, 4, 3), (128, 128, 8, 8, 2), (128, 128, 8, 8, 3), (128, 128, 8, 8, 4), (128, 64, 8, 4, 3),
           (64, 64, 8, 4, 4)],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--ms", type=int, nargs="*", default=MS)
    parser.add_argument("--quick", action="store_true", help="the first three candidates of each kind only")
    args = parser.parse_args()
    flush = make_l2_flush_buffer()
    records, summary = [], []
    print(f"device {torch.cuda.get_device_name()}")
    for k, n in SHAPES:
        levels = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda")
        scales = (torch.rand(n, k // GROUP_SIZE, device="cuda") * 0.004 + 0.001).to(torch.bfloat16)
        w4 = pack_w4a16_for_gpu(levels, scales, None)
        dense = dequantize_w4a16(w4, k, GROUP_SIZE).to(torch.bfloat16)
        fp8_scale = dense.float().abs().amax(dim=1, keepdim=True) / 448
        fp8_weight = (dense.float() / fp8_scale).to(torch.float8_e4m3fn)
        for m in args.ms:
            if m > 1024 and k > 4096 and args.quick:
                continue
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            reference = F.linear(x, dense).float()
            runs = {
                "bf16": lambda: F.linear(x, dense),
                "w4a16_now": lambda: w4a16_linear(x, w4["qweight"], w4["scales"], None, None, GROUP_SIZE),
                "w8a8": lambda: fp8_linear(x, fp8_weight, fp8_scale, None),
            }
            for kind, candidates in CANDIDATES.items():
                for bm, bn, gm, nw, ns in candidates[:3] if args.quick else candidates:
                    if bm > 2 * m and bm > 64:
                        continue
                    name = f"{kind}-{bm}x{bn}-g{gm}-w{nw}-s{ns}"
                    runs[name] = (lambda bm=bm, bn=bn, gm=gm, nw=nw, ns=ns, kind=kind: launch_w4a16_mma(
                        x, w4["qweight"], w4["scales"], None, None, GROUP_SIZE, bm, bn, gm, nw, ns,
                        a_fp8=kind == "w4a8", fast_cvt=kind == "cvt"))
            times = {}
            for name, fn in runs.items():
                try:
                    err = float((fn().float() - reference).norm() / reference.norm())
                    limit = 6e-2 if name.startswith(("w4a8", "w8a8")) else 1e-2
                    if not err < limit:
                        print(f"{k}x{n} M={m} {name}: wrong (relative error {err:.2e})")
                        continue
                    times[name] = median_time_ms(fn, flush) * 1000
                    records.append({"K": k, "N": n, "M": m, "name": name, "us": round(times[name], 2), "rel_err": err})
                except Exception as exc:  # a tile that does not fit this GPU
                    print(f"{k}x{n} M={m} {name}: {type(exc).__name__}: {str(exc)[:160]}")
            best = {kind: min(((t, nm) for nm, t in times.items() if nm.startswith(kind + "-")), default=(None, None))
                    for kind in CANDIDATES}
            row = {"K": k, "N": n, "M": m, "bf16_us": round(times["bf16"], 2)}
            for label, (t, nm) in [("w4a16_now", (times.get("w4a16_now"), "table")), ("w8a8", (times.get("w8a8"), "")),
                                   ("mma", best["mma"]), ("cvt", best["cvt"]), ("w4a8", best["w4a8"])]:
                if t is not None:
                    row[label] = {"us": round(t, 2), "vs_bf16": round(times["bf16"] / t, 3), "config": nm}
            summary.append(row)
            cells = "  ".join(f"{lb} {row[lb]['vs_bf16']:.2f}x ({row[lb]['us']:.1f} us {row[lb]['config']})"
                              for lb in ("w4a16_now", "w8a8", "mma", "cvt", "w4a8") if lb in row)
            print(f"{k}x{n} M={m}: bf16 {times['bf16']:.1f} us  {cells}", flush=True)
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "summary": summary, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
