"""The CPU's two forms of DeepSeek's latent attention (kernels/mla_attention.py) timed against each other, to set
EXPAND_MIN_QUERIES: one sequence of `context` cached tokens computing its last `queries` of them, at DeepSeek-V2-Lite's
attention shape (16 heads, 128 + 64 q/k dims, 128 v dims, latent 512 + 64), float32 and bfloat16.

    python benchmarks/mla_forms.py [--threads 2]

Prints, per (dtype, context, queries), the milliseconds of each form and which is faster.
"""

from __future__ import annotations

import argparse
import time

import torch

from llmc.kernels.mla_attention import mla_attention

HEADS, NOPE, ROPE, V, RANK, BLOCK = 16, 128, 64, 128, 512, 16


def timed(fn, repeats: int = 5) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        w_uk = (torch.randn(HEADS, NOPE, RANK, generator=gen) * RANK ** -0.5).to(dtype)
        w_uv = (torch.randn(HEADS, V, RANK, generator=gen) * RANK ** -0.5).to(dtype)
        kv_b = torch.cat((w_uk, w_uv), dim=1).flatten(0, 1)  # [heads * (nope + v), rank]

        def expand(c_kv):
            kv = torch.nn.functional.linear(c_kv, kv_b).view(-1, HEADS, NOPE + V)
            return kv.split([NOPE, V], dim=-1)

        for context in (256, 2048):
            blocks = -(-context // BLOCK)
            cache = torch.randn(blocks, BLOCK, RANK + ROPE, generator=gen).to(dtype)
            tables = torch.arange(blocks, dtype=torch.int32)[None]
            lens = torch.tensor([context], dtype=torch.int32)
            for queries in (1, 2, 4, 8, 16, 64, 256):
                q = torch.randn(queries, HEADS, NOPE + ROPE, generator=gen).to(dtype)
                run = {form: (lambda form=form: mla_attention(q, cache, w_uk, w_uv, tables, lens, [queries], 0.1,
                                                              expand=expand, form=form))
                       for form in ("absorbed", "expanded")}
                ms = {form: timed(fn) for form, fn in run.items()}
                print(f"{str(dtype):15} context {context:5} queries {queries:4}: absorbed {ms['absorbed']:8.2f} ms, "
                      f"expanded {ms['expanded']:8.2f} ms -> {min(ms, key=ms.get)}", flush=True)


if __name__ == "__main__":
    main()
