"""The decode attention kernel's tile (keys per tile) and launch (warps, pipeline stages), measured on
the engine's decode shapes (issue 12: attention is ~17% of a bf16 128/128 run's kernel time at 512 rows).

    source benchmarks/gpu_env.sh && python benchmarks/decode_attention_sweep.py [--json OUT.json]
        [--block-n 32 64 128] [--warps 4 8] [--stages 2 3] [--caches bfloat16 float8_e4m3fn]

Llama-3-8B heads (32 q, 8 kv, head_dim 128), 16-token blocks in a shuffled cache, a bf16 and an FP8
cache. Each case is timed as the engine runs it: captured in a CUDA graph with max_context_len =
max_model_len (4096), cold L2, median of 25 replays (kernels/timing.py). Every configuration's output is
compared with the current default's (rel_err_vs_default in the JSON). Prints µs, KV GB/s and the speed-up
of the best configuration over the default, per case and cache dtype.
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

CASES = {  # name: (number of sequences, context lengths drawn from [low, high])
    "512 x ctx 129-256": (512, 129, 256),
    "256 x ctx 129-256": (256, 129, 256),
    "64 x ctx 1024": (64, 1024, 1024),
    "8 x ctx 4096": (8, 4096, 4096),
}


def make_case(num_seqs: int, low: int, high: int, cache_dtype: torch.dtype, gen: torch.Generator):
    context_lens = torch.randint(low, high + 1, (num_seqs,), generator=gen)
    blocks_per_seq = -(-4096 // 16)
    num_blocks = num_seqs * -(-high // 16) + 1
    k_cache = torch.randn(num_blocks, 16, 8, 128, generator=gen).to("cuda", cache_dtype)
    v_cache = torch.randn(num_blocks, 16, 8, 128, generator=gen).to("cuda", cache_dtype)
    block_tables = torch.zeros(num_seqs, blocks_per_seq, dtype=torch.int32)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).to(torch.int32)
    used = -(-high // 16)
    block_tables[:, :used] = order[: num_seqs * used].view(num_seqs, used)
    q = torch.randn(num_seqs, 32, 128, generator=gen).to("cuda", torch.bfloat16)
    lens = context_lens.to(torch.int32).to("cuda")
    kv_bytes = int(context_lens.sum()) * 8 * 128 * 2 * torch.finfo(cache_dtype).bits // 8
    return (q, k_cache, v_cache, block_tables.cuda(), lens, [1] * num_seqs, 128**-0.5, None, 4096), kv_bytes


def run(config, args) -> torch.Tensor:
    block_n, warps, stages = config
    attention_triton.DECODE_BLOCK_N = {False: block_n, True: block_n}
    attention_triton.DECODE_LAUNCH = {"num_warps": warps, "num_stages": stages}
    return attention_triton.paged_attention(*args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=Path("decode_attention_sweep.json"))
    parser.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128], help="keys per tile")
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--caches", nargs="+", default=["bfloat16", "float8_e4m3fn"], choices=["bfloat16", "float8_e4m3fn"])
    args = parser.parse_args(argv)
    configs = list(itertools.product(args.block_n, args.warps, args.stages))
    block_n, launch = dict(attention_triton.DECODE_BLOCK_N), attention_triton.DECODE_LAUNCH
    flush, gen, results = make_l2_flush_buffer(), torch.Generator().manual_seed(0), []
    caches = [getattr(torch, name) for name in args.caches]
    for (name, (num_seqs, low, high)), cache_dtype in itertools.product(CASES.items(), caches):
        default = (block_n[cache_dtype == torch.float8_e4m3fn], launch["num_warps"], launch["num_stages"])
        case_args, kv_bytes = make_case(num_seqs, low, high, cache_dtype, gen)
        reference = run(default, case_args).float()
        row = {"case": name, "cache": str(cache_dtype).removeprefix("torch."), "configs": {}}
        for config in sorted(set(configs) | {default}):
            out = run(config, case_args).float()
            error = float((out - reference).norm() / reference.norm())
            us = median_time_ms(lambda: run(config, case_args), flush) * 1000  # noqa: B023 - timed now
            row["configs"]["%d/%d/%d" % config] = {"us": round(us, 1), "kv_GBps": round(kv_bytes / us / 1e3),
                                                  "rel_err_vs_default": round(error, 6)}
        base = row["configs"]["%d/%d/%d" % default]["us"]
        best = min(row["configs"].items(), key=lambda item: item[1]["us"])
        print(f"{name} {row['cache']}: default {base} us ({row['configs']['%d/%d/%d' % default]['kv_GBps']} GB/s); "
              f"best {best[0]} (block_n/warps/stages) {best[1]['us']} us ({best[1]['kv_GBps']} GB/s, "
              f"{base / best[1]['us']:.3f}x)", flush=True)
        print("   " + "  ".join(f"{k}:{v['us']}" for k, v in row["configs"].items()), flush=True)
        results.append(row)
    attention_triton.DECODE_BLOCK_N, attention_triton.DECODE_LAUNCH = block_n, launch
    args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "default_block_n": str(block_n),
                                     "default_launch": launch, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
