"""Where the W4A8 kernel's time goes (probe; kernels/w4a8_ws.py's DIAG switch exists only in the probe
commit): the kernel alone on pre-quantized activations, with the conversion replaced by a constant
operand (DIAG 1), without the per-tile scale (the products accumulated in place; DIAG 2), both (3),
beside torch bf16 and the W4A16 table. Timer: kernels/timing (CUDA-graph replays, cold L2, medians).

    python benchmarks/w4a8_ws_diag.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from llmc.kernels.fp8 import MIN_SCALE
from llmc.kernels.fp8_triton import quantize_fp8_per_token
from llmc.kernels.timing import make_l2_flush_buffer, median_time_ms
from llmc.kernels.w4a16_gemm import dequantize_w4a16, pack_w4a16_for_gpu, w4a16_linear
from llmc.kernels.w4a8_ws import launch_w4a8_ws


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    flush = make_l2_flush_buffer(torch.device("cuda"))
    rows = []
    for k, n in ((4096, 28672), (4096, 4096)):
        levels = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda")
        scales = (torch.rand(n, k // 128, device="cuda") * 0.004 + 0.001).to(torch.bfloat16)
        params = pack_w4a16_for_gpu(levels, scales, None)
        dense = dequantize_w4a16(params, k, 128).to(torch.bfloat16)
        for m in (1024, 4096):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            x8, xs = quantize_fp8_per_token(x, MIN_SCALE, permute=True)
            row = {"k": k, "n": n, "m": m,
                   "bf16": median_time_ms(lambda: F.linear(x, dense), flush) * 1e3,
                   "w4a16": median_time_ms(lambda: w4a16_linear(x, params["qweight"], params["scales"], None, None,
                                                                128), flush) * 1e3,
                   "quant": median_time_ms(lambda: quantize_fp8_per_token(x, MIN_SCALE, permute=True), flush) * 1e3}
            for block_m, stages, diags in ((128, 4, (0, 1, 2, 3)), (128, 8, (0, 1, 2, 3)), (64, 8, (0, 3)),
                                           (256, 4, (2, 3))):
                for diag in diags:
                    fn = (lambda b=block_m, s=stages, d=diag: launch_w4a8_ws(
                        x8, xs, params["qweight"], params["scales"], None, None, 128, b, 1, s, torch.bfloat16, d))
                    try:
                        row[f"m{block_m}_s{stages}_d{diag}"] = median_time_ms(fn, flush) * 1e3
                    except Exception as exc:
                        row[f"m{block_m}_s{stages}_d{diag}"] = repr(exc)[:200]
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
