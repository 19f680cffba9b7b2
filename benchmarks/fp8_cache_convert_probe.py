"""PROBE (session 29): how the decode-attention kernel widens an FP8 KV cache, timed on the engine's decode
shapes (decode_attention_sweep.py's cases and timer: CUDA-graph replays, cold L2, median).

    source benchmarks/gpu_env.sh && python benchmarks/fp8_cache_convert_probe.py [--json OUT.json]

attention_triton.FP8_CACHE_CONVERT: 0 a cast to q's dtype (bf16: cvt.rn.f16x2.e4m3x2 and a cvt.bf16.f16
per value), 1 the dots in fp16 (q cast once; K and V by the one cvt), 2 the bits placed in a float32,
times 2**120 (exact, then to bf16). Each with 32- and 64-key tiles; the bf16 cache's time beside them.
Prints µs, KV GB/s, and each output's relative difference from mode 0 at the same tile (0 must be exact
for mode 2).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

from llmc.kernels import attention_triton
from llmc.kernels.timing import make_l2_flush_buffer, median_time_ms

sys.path.insert(0, str(Path(__file__).parent))
from decode_attention_sweep import CASES, make_case  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=Path("fp8_cache_convert_probe.json"))
    args = parser.parse_args(argv)
    flush, results = make_l2_flush_buffer(), []
    for name, (num_seqs, low, high) in CASES.items():
        row = {"case": name}
        for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            case_args, kv_bytes = make_case(num_seqs, low, high, cache_dtype, torch.Generator().manual_seed(0))
            modes = [(0, 64)] if cache_dtype == torch.bfloat16 else list(itertools.product((0, 1, 2), (32, 64)))
            outs = {}
            for mode, block_n in modes:
                attention_triton.FP8_CACHE_CONVERT = mode
                attention_triton.DECODE_BLOCK_N = {False: block_n, True: block_n}
                run = lambda: attention_triton.paged_attention(*case_args)  # noqa: E731
                outs[mode, block_n] = run().float()
                us = median_time_ms(run, flush) * 1000
                base = outs.get((0, block_n), outs[mode, block_n])
                diff = float((outs[mode, block_n] - base).norm() / base.norm())
                key = f"{str(cache_dtype).removeprefix('torch.')} mode {mode} block {block_n}"
                row[key] = {"us": round(us, 1), "kv_GBps": round(kv_bytes / us / 1e3), "rel_diff_vs_mode0": diff,
                            "bit_equal_mode0": bool(torch.equal(outs[mode, block_n], base))}
                print(f"{name:>18} {key:>32}: {us:7.1f} us {kv_bytes / us / 1e3:6.0f} GB/s  vs mode 0: {diff:.2e}"
                      f"{' (bit-equal)' if torch.equal(outs[mode, block_n], base) else ''}", flush=True)
        results.append(row)
    attention_triton.FP8_CACHE_CONVERT, attention_triton.DECODE_BLOCK_N = 0, {False: 64, True: 32}
    args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
