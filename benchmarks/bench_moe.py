"""Fused MoE kernel vs per-expert loops, per layer, on Mixtral-8x7B and Qwen3-30B-A3B expert shapes
(random weights). GPU: `python benchmarks/bench_moe.py [--json OUT.json]`; tile sweep on the GPU:
`--sweep` (every candidate of SWEEP for each kind, shape and M, with the table's choice marked);
CPU check of the script: `--smoke` (tiny shapes, the torch reference paths, one iteration).

Rows per shape, batch size M and kind (the same routing for all):
  bf16    fused (dense experts)  vs  the per-expert loop of torch matmuls
  w4a16   fused (gpu layout, g128 symmetric, unpacked in the GEMM)  vs  the per-expert loop through
          the w4a16 format's own linear (kernels/w4a16_gemm.w4a16_linear, its tuned table)  and  the
          bf16 loop
  fp8     fused (w8a8-fp8: per-token dynamic FP8 inputs, FP8 × FP8)  vs  the per-expert loop through
          kernels/fp8.fp8_linear  and  the bf16 loop
  fp8-block  fused (w8a8-fp8-block: 128 x 128 weight blocks, inputs per token and 128 columns)  vs  the
          per-expert loop through the format's own linear (Triton / cuBLAS block-scaled)  and  the bf16 loop
Each fused result is checked against its own loop first. Times are µs per layer (gate_up + SiLU +
down + combine, routing excluded): "fused" and the loops are eager calls between two synchronisations
(host launches included); "graph" is the fused op's GPU time as a decode step pays it (CUDA-graph
replays after an L2 flush, median, kernels/timing.py; GPU only). GB/s = weight bytes of the experts
that received tokens / graph time (fused time on a CPU).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from llmc.kernels.fp8 import fp8_linear
from llmc.kernels.fused_moe import ExpertWeights, MoeConfig, fused_moe_experts, select_moe_config
from llmc.kernels.timing import make_l2_flush_buffer, median_time_ms
from llmc.kernels.w4a16_gemm import pack_w4a16_for_gpu, w4a16_linear
from llmc.quant.formats import Fp8BlockFormat
from llmc.quant.fp8 import quantize_fp8_weight_block

SHAPES = {"mixtral-8x7b": (4096, 14336, 8, 2), "qwen3-30b-a3b": (2048, 768, 128, 8)}  # hidden, inter, E, k
SMOKE = {"smoke": (128, 128, 4, 2)}
BATCHES, SMOKE_BATCHES = (1, 16, 128, 1024), (1, 8)
KINDS = ("bf16", "w4a16", "fp8", "fp8-block")
SWEEP = (  # (block_m, block_n, block_k, num_warps, num_stages, w4_tiles): w4a16 steps w4_tiles packed
    # 128-column tiles in place of block_k; the table's choice is timed too when it is not listed
    MoeConfig(16, 32, 128, 4, 4, 2), MoeConfig(16, 64, 128, 4, 4, 1), MoeConfig(16, 64, 128, 4, 4, 2),
    MoeConfig(16, 64, 256, 4, 3, 4), MoeConfig(16, 128, 128, 4, 4, 2), MoeConfig(32, 64, 64, 4, 4, 1),
    MoeConfig(32, 128, 64, 4, 3, 1), MoeConfig(64, 64, 64, 4, 4, 1), MoeConfig(64, 128, 64, 4, 3, 1),
    MoeConfig(64, 128, 64, 8, 3, 1), MoeConfig(128, 128, 64, 8, 3, 1),
)
GROUP_SIZE = 128


def loop(x, weights, ids, num_experts, linear_gate_up, linear_down):
    """The per-expert loop: each expert that received tokens runs its two linears on them."""
    out = torch.zeros_like(x)
    for e in range(num_experts):
        token, slot = torch.where(ids == e)
        if token.numel():
            gate, up = linear_gate_up(e, x[token]).chunk(2, dim=-1)
            out.index_add_(0, token, linear_down(e, F.silu(gate) * up) * weights[token, slot, None].to(x.dtype))
    return out


def make_experts(kind: str, w1: torch.Tensor, w2: torch.Tensor) -> tuple[ExpertWeights, ExpertWeights, tuple]:
    """(fused gate_up, fused down, (per-expert gate_up linear, down linear)) for dense weights [E, N, K]."""
    if kind == "bf16":
        return ExpertWeights(w1), ExpertWeights(w2), (lambda e, x: F.linear(x, w1[e]), lambda e, x: F.linear(x, w2[e]))
    if kind == "fp8":
        (q1, s1), (q2, s2) = _fp8(w1), _fp8(w2)
        linears = (lambda e, x: fp8_linear(x, q1[e], s1[e][:, None], None),
                   lambda e, x: fp8_linear(x, q2[e], s2[e][:, None], None))
        return ExpertWeights(q1, "w8a8-fp8", s1), ExpertWeights(q2, "w8a8-fp8", s2), linears
    if kind == "fp8-block":
        fmt = Fp8BlockFormat(w1.dtype)
        p1, p2 = _fp8_block(fmt, w1), _fp8_block(fmt, w2)
        linears = (lambda e, x: fmt.apply(x, p1[e], None), lambda e, x: fmt.apply(x, p2[e], None))
        fused = [ExpertWeights(torch.stack([p["weight"] for p in ps]), "w8a8-fp8-block",
                               torch.stack([p["weight_scale"] for p in ps]), group_size=fmt.group_size) for ps in (p1, p2)]
        return fused[0], fused[1], linears
    p1, p2 = _w4a16(w1), _w4a16(w2)
    linears = (lambda e, x: w4a16_linear(x, p1["qweight"][e], p1["scales"][e], None, None, GROUP_SIZE),
               lambda e, x: w4a16_linear(x, p2["qweight"][e], p2["scales"][e], None, None, GROUP_SIZE))
    fused = [ExpertWeights(p["qweight"], "w4a16", p["scales"], None, GROUP_SIZE, w.shape[2]) for p, w in ((p1, w1), (p2, w2))]
    return fused[0], fused[1], linears


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.float().abs().amax(dim=2) / 448).clamp(min=1e-12)  # [E, N]
    return (w.float() / scale[:, :, None]).to(torch.float8_e4m3fn), scale


def _fp8_block(fmt: Fp8BlockFormat, w: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Each expert packed in the w8a8-fp8-block format, with the layouts it derives at load (cuBLAS's scales)."""
    params = [fmt.pack(quantize_fp8_weight_block(we.float(), fmt.block_size)) for we in w]
    return [p | fmt.derived_params(p) for p in params]


def _w4a16(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """RTN g128 symmetric, packed expert by expert into the gpu layout, stacked."""
    packed = []
    for we in w:
        groups = we.float().unflatten(1, (-1, GROUP_SIZE))  # [N, G, 128]
        scale = (groups.abs().amax(dim=2) / 7.5).clamp(min=1e-8)  # [N, G]
        levels = (groups / scale[:, :, None] + 8).round().clamp(0, 15).to(torch.int32).flatten(1)
        packed.append(pack_w4a16_for_gpu(levels, scale.to(w.dtype), None))
    return {name: torch.stack([p[name] for p in packed]) for name in packed[0]}


def timed(fn, iters: int) -> float:
    """µs per call after one warm-up call."""
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1e6


def weight_bytes(fused: tuple[ExpertWeights, ExpertWeights], ids: torch.Tensor) -> int:
    """Bytes of the experts that received tokens (all their tensors, both projections)."""
    active = int(torch.unique(ids).numel())
    return sum(t[0].numel() * t.element_size() * active
               for w in fused for t in (w.weight, w.scale, w.zeros) if t is not None)


def routing(m: int, num_experts: int, top_k: int, device: str, seed: int):
    gen = torch.Generator(device).manual_seed(seed)
    probs = torch.softmax(torch.randn(m, num_experts, device=device, generator=gen), dim=-1)
    return torch.topk(probs, top_k, dim=-1)


def graph_time_us(fn, flush) -> float | None:
    """The GPU time of fn as a decode step pays it: CUDA-graph replays after an L2 flush, median (µs);
    None on a CPU."""
    return median_time_ms(fn, flush) * 1e3 if flush is not None else None


def bench_shape(name, shape, kinds, batches, device, dtype, iters, sweep) -> list[dict]:
    hidden, inter, num_experts, top_k = shape
    flush = make_l2_flush_buffer(device) if device == "cuda" else None
    gen = torch.Generator(device).manual_seed(0)
    w1 = 0.02 * torch.randn(num_experts, 2 * inter, hidden, device=device, dtype=dtype, generator=gen)
    w2 = 0.02 * torch.randn(num_experts, hidden, inter, device=device, dtype=dtype, generator=gen)
    bf16_loop = make_experts("bf16", w1, w2)[2]
    rows = []
    for kind in kinds:
        gate_up, down, linears = make_experts(kind, w1, w2)
        for m in batches:
            x = torch.randn(m, hidden, device=device, dtype=dtype, generator=gen)
            weights, ids = routing(m, num_experts, top_k, device, m)
            want = loop(x, weights, ids, num_experts, *linears).float()
            got = fused_moe_experts(x, weights, ids, gate_up, down).float()
            error = float((got - want).norm() / want.norm())
            assert error < 3e-2, f"{name} {kind} M={m}: fused vs loop relative error {error:.3g}"
            chosen = select_moe_config(m, top_k, num_experts, gate_up.kind)
            configs = (chosen, *(c for c in SWEEP if c != chosen)) if sweep else (chosen,)
            for config in configs:
                run = lambda: fused_moe_experts(x, weights, ids, gate_up, down, config)  # noqa: E731
                fused = timed(run, iters)
                row = {"shape": name, "kind": kind, "M": m, "config": vars(config) | {"chosen": config == chosen},
                       "fused_us": fused, "graph_us": graph_time_us(run, flush)}
                row["gb_per_s"] = weight_bytes((gate_up, down), ids) / (row["graph_us"] or fused) / 1e3
                if config == chosen:
                    row["loop_us"] = timed(lambda: loop(x, weights, ids, num_experts, *linears), iters)
                    row["bf16_loop_us"] = timed(lambda: loop(x, weights, ids, num_experts, *bf16_loop), iters)
                rows.append(row)
                print(format_row(row), flush=True)
    return rows


HEADER = f"{'shape':<15}{'kind':<10}{'M':>6}{'fused µs':>11}{'graph µs':>10}{'GB/s':>8}{'loop µs':>11}{'bf16 loop µs':>14}{'loop/fused':>12}  tiles"


def format_row(row: dict) -> str:
    c = row["config"]
    tiles = f"{c['block_m']}x{c['block_n']}x{c['block_k']} w{c['num_warps']} s{c['num_stages']} t{c['w4_tiles']}"
    tiles += " *" if c["chosen"] else ""
    loop_us, bf16_us = row.get("loop_us"), row.get("bf16_loop_us")
    cells = (f"{loop_us:>11.1f}{bf16_us:>14.1f}{loop_us / row['fused_us']:>12.2f}" if loop_us is not None
             else f"{'':>11}{'':>14}{'':>12}")
    graph = f"{row['graph_us']:>10.1f}" if row["graph_us"] is not None else f"{'-':>10}"
    return f"{row['shape']:<15}{row['kind']:<10}{row['M']:>6}{row['fused_us']:>11.1f}{graph}{row['gb_per_s']:>8.1f}{cells}  {tiles}"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (the torch reference paths)")
    parser.add_argument("--sweep", action="store_true", help="time every SWEEP tile config (table's choice: *)")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated: bf16, w4a16, fp8, fp8-block")
    parser.add_argument("--shapes", default=None, help=f"comma-separated of {sorted(SHAPES)} (default: all)")
    parser.add_argument("--batches", default=None, help="comma-separated M (default: 1,16,128,1024)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    kinds = args.kinds.split(",")
    if unknown := set(kinds) - set(KINDS):
        parser.error(f"unknown kinds {sorted(unknown)}; use {KINDS}")
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes = SMOKE if args.smoke else {name: SHAPES[name] for name in (args.shapes.split(",") if args.shapes else SHAPES)}
    batches = [int(m) for m in args.batches.split(",")] if args.batches else (SMOKE_BATCHES if args.smoke else BATCHES)
    print(f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, {dtype}\n{HEADER}", flush=True)
    rows = []
    for name, shape in shapes.items():
        rows += bench_shape(name, shape, kinds, batches, device, dtype, 1 if args.smoke else args.iters, args.sweep)
        if args.json:
            args.json.write_text(json.dumps({"device": device, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
