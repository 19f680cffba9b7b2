"""Issue 13: where the W4A16 time goes at few tokens (the decode GEMVs), in one device run.

    python benchmarks/w4a16_small_m_probe.py --json OUT/small_m_probe.json [--before DIR]
    ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section Occupancy \
        python benchmarks/w4a16_small_m_probe.py --ncu          # the same kernels once each, no timer

For each Llama-3-8B linear (K × N), with the bench_kernels timer (CUDA-graph replays, cold L2, median):
  read_us     a Triton kernel that only reads the packed weight and its scales (16-byte loads, 4
              programs per SM): what streaming those bytes costs here, launch included;
  torch_sum_us  torch's sum over the same bytes (another streaming kernel);
  bf16_us     torch bf16 F.linear at M tokens;
  w4a16_us    w4a16_linear at M tokens with the default table's config (rel_err: against the float32
              product);
and once: `empty_us` (one empty kernel) and `empty2_us` (two in one graph): the fixed cost of a kernel.
With --before DIR (a copy of an earlier tree), `before_us`: the same config through DIR/kernels, in the
same run.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from llmc.kernels import device_num_sms
from llmc.kernels.timing import make_l2_flush_buffer, median_time_ms
from llmc.kernels.w4a16_gemm import dequantize_w4a16, pack_w4a16_for_gpu, select_w4a16_config, w4a16_linear

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
MS = [1, 4, 16, 64, 256]


def load_before(tree: Path):
    """DIR/kernels imported as the package `before_kernels` (kernels/ imports nothing of llmc)."""
    spec = importlib.util.spec_from_file_location("before_kernels", tree / "kernels" / "__init__.py",
                                                  submodule_search_locations=[str(tree / "kernels")])
    package = importlib.util.module_from_spec(spec)
    sys.modules["before_kernels"] = package
    spec.loader.exec_module(package)
    return importlib.import_module("before_kernels.w4a16_gemm")


@triton.jit
def _read_kernel(ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid, num_programs = tl.program_id(0), tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(pid * BLOCK, n, num_programs * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc ^= tl.load(ptr + offs, mask=offs < n, other=0)
    tl.store(out_ptr + pid * BLOCK + tl.arange(0, BLOCK), acc)


@triton.jit
def _empty_kernel(out_ptr):
    pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--ncu", action="store_true", help="run each kernel once (for ncu), time nothing")
    parser.add_argument("--before", type=Path, help="an earlier tree: its kernels timed beside these")
    args = parser.parse_args(argv)
    before = load_before(args.before) if args.before else None
    flush = make_l2_flush_buffer()
    num_sms = device_num_sms(torch.device("cuda"))
    block, programs = 2048, 4 * num_sms
    sink = torch.empty(programs * block, dtype=torch.int32, device="cuda")
    rows = []
    if not args.ncu:
        rows.append({"empty_us": 1000 * median_time_ms(lambda: _empty_kernel[(1,)](sink), flush),
                     "empty2_us": 1000 * median_time_ms(lambda: (_empty_kernel[(1,)](sink), _empty_kernel[(1,)](sink)),
                                                        flush)})
        print(rows[-1], flush=True)
    for k, n in SHAPES:
        levels = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda")
        scales = (torch.rand(n, k // 128, device="cuda") * 0.004 + 0.001).to(torch.bfloat16)
        w4 = pack_w4a16_for_gpu(levels, scales, None)
        dense = dequantize_w4a16(w4, k, 128).to(torch.bfloat16)
        words = torch.cat([w4["qweight"].flatten(), w4["scales"].flatten().view(torch.int32)])
        read = lambda: _read_kernel[(programs,)](words, sink, words.numel(), BLOCK=block, num_warps=8)
        torch_sum = lambda: words.view(torch.float32).sum()
        row = {"shape": f"{k}x{n}", "bytes": words.numel() * 4}
        if args.ncu:
            read()
        else:
            row["read_us"] = 1000 * median_time_ms(read, flush)
            row["torch_sum_us"] = 1000 * median_time_ms(torch_sum, flush)
        for m in MS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            run = lambda: w4a16_linear(x, w4["qweight"], w4["scales"], None, None, 128)
            config = select_w4a16_config(m, k, n, None, num_sms)
            expected = F.linear(x.float(), dense.float())
            err = ((run().float() - expected).norm() / expected.norm()).item()
            if args.ncu:
                run()
                F.linear(x, dense)
                continue
            row[f"m{m}"] = {
                "config": config.to_dict(), "rel_err": err,
                "bf16_us": 1000 * median_time_ms(lambda: F.linear(x, dense), flush),
                "w4a16_us": 1000 * median_time_ms(run, flush),
            }
            if before is not None:
                old = before.run_w4a16_config
                config_before = before.W4A16Config(**config.to_dict())
                run_before = lambda: old(x, w4["qweight"], w4["scales"], None, None, 128, config_before)
                row[f"m{m}"]["same_bits_as_before"] = torch.equal(run_before(), run())
                row[f"m{m}"]["before_us"] = 1000 * median_time_ms(run_before, flush)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
