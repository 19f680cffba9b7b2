"""Fused MoE kernel vs a per-expert loop of torch matmuls, per layer, on Mixtral-8x7B and
Qwen3-30B-A3B expert shapes (bf16, random weights). GPU: `python benchmarks/bench_moe.py`; CPU check
of the script: `--smoke` (tiny shapes, the torch reference path, one iteration).

Prints, per shape and batch size M: fused time, loop time (µs) and their ratio, after checking that
both give the same output. Not yet here (issue 18 item 5): W4A16 (the kernel has no W4 mode), and
batch-1 decode ms/token and 128/128 throughput of a built artifact.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from llmc.kernels.fused_moe import fused_moe

SHAPES = {"mixtral-8x7b": (4096, 14336, 8, 2), "qwen3-30b-a3b": (2048, 768, 128, 8)}  # hidden, inter, E, k
SMOKE = {"smoke": (64, 96, 4, 2)}


def per_expert_loop(x, weights, ids, w1, w2):
    out = torch.zeros_like(x)
    for e in range(w1.shape[0]):
        token, slot = torch.where(ids == e)
        if token.numel():
            gate, up = F.linear(x[token], w1[e]).chunk(2, dim=-1)
            out.index_add_(0, token, F.linear(F.silu(gate) * up, w2[e]) * weights[token, slot, None].to(x.dtype))
    return out


def timed(fn, iters: int) -> float:
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    iters = 1 if args.smoke else 20
    print(f"{'shape':<16}{'M':>6}{'fused µs':>12}{'loop µs':>12}{'loop/fused':>12}")
    for name, (hidden, inter, num_experts, top_k) in (SMOKE if args.smoke else SHAPES).items():
        w1 = 0.02 * torch.randn(num_experts, 2 * inter, hidden, device=device, dtype=dtype)
        w2 = 0.02 * torch.randn(num_experts, hidden, inter, device=device, dtype=dtype)
        for m in ([1, 8] if args.smoke else [1, 16, 128, 1024]):
            x = torch.randn(m, hidden, device=device, dtype=dtype)
            probs = torch.softmax(torch.randn(m, num_experts, device=device), dim=-1)
            weights, ids = torch.topk(probs, top_k, dim=-1)
            want = per_expert_loop(x, weights, ids, w1, w2).float()
            got = fused_moe(x, weights, ids, w1, w2).float()
            assert (got - want).norm() <= 2e-2 * want.norm(), name
            fused = timed(lambda: fused_moe(x, weights, ids, w1, w2), iters)
            loop = timed(lambda: per_expert_loop(x, weights, ids, w1, w2), iters)
            print(f"{name:<16}{m:>6}{fused:>12.1f}{loop:>12.1f}{loop / fused:>12.2f}")


if __name__ == "__main__":
    main()
