"""What act order costs on the W4A16 kernels (issue 13): the same 4-bit weight in the gpu layout with
contiguous groups and with act-order groups (`perm`: x gathered before the kernel), and the plain
act-order layout the runtime used before (dequantized every forward), beside torch bf16.

    python benchmarks/act_order_cost.py [--json OUT/act_order_cost.json]

Llama-3-8B shapes, group 128, symmetric, bf16; kernels/timing.py's timer (graph replays, cold L2).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from llmc.kernels.timing import make_l2_flush_buffer, median_time_ms
from llmc.quant.formats import IntWeightFormat, QuantizedWeight

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--ms", default="1,16,256,4096")
    args = parser.parse_args(argv)
    flush, rows = make_l2_flush_buffer(), []
    for k, n in SHAPES:
        levels = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda")
        scales = torch.rand(n, k // 128, device="cuda") * 0.01 + 0.001
        order = torch.randperm(k, device="cuda")
        g_idx = torch.empty(k, dtype=torch.int32, device="cuda")
        g_idx[order] = torch.arange(k, dtype=torch.int32, device="cuda") // 128
        contiguous = IntWeightFormat(torch.bfloat16, 4, 128, True, layout="gpu")
        act_order = IntWeightFormat(torch.bfloat16, 4, 128, True, has_g_idx=True, layout="gpu")
        plain = IntWeightFormat(torch.bfloat16, 4, 128, True, has_g_idx=True)
        q, q_act = QuantizedWeight(levels, scales, None, 4, 128), QuantizedWeight(levels, scales, None, 4, 128, g_idx)
        params = {"contiguous": contiguous.pack(q), "act_order": act_order.pack(q_act), "plain": plain.pack(q_act)}
        dense = plain.dequantize(params["plain"], k).to(torch.bfloat16)
        for m in map(int, args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            times = {
                "bf16": median_time_ms(lambda: F.linear(x, dense), flush),
                "w4a16": median_time_ms(lambda: contiguous.apply(x, params["contiguous"], None), flush),
                "w4a16_act_order": median_time_ms(lambda: act_order.apply(x, params["act_order"], None), flush),
                "plain_act_order": median_time_ms(lambda: plain.apply(x, params["plain"], None), flush),
            }
            row = {"K": k, "N": n, "M": m, **{f"{name}_us": round(1000 * t, 2) for name, t in times.items()}}
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
