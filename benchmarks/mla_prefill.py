"""DeepSeek's latent attention of a prefill on CUDA, absorbed form against expanded (kernels/mla_attention.py).

Sets CUDA_EXPAND_MIN_QUERIES and CUDA_EXPAND_MIN_WORK: the absorbed Triton kernel (every query row over its causal prefix of 576-value
latents) against the expanded path (kv_b over the context's latents, then torch's scaled_dot_product_attention,
lower-right causal), each through mla_attention with its form forced, at DeepSeek-V2-Lite's (16 heads) and
DeepSeek-V3's (128 heads) attention shape: 128 + 64 q/k dims, 128 v dims, latent 512 + 64, bf16, blocks of 16 tokens.

    python -P benchmarks/mla_prefill.py --out mla_prefill.json [--lengths 128,512,2048,8192] [--cached 4096] [--reps 7]

Cases per shape: one sequence prefilling its whole prompt of each length, and a 512-query chunk after each --cached
count of cached tokens. Contexts past a chunk (mla_attention.expand_chunk_keys: 8192 keys at V3's 128 heads, 65536 at
V2-Lite's 16) take the expanded form in chunks merged by their log-sum-exps: `--lengths 16384,32768 --cached 100000`
measures those. Times are CUDA events around each call, median of --reps after warm-up, a cold L2 before each (the
attention alone: the eager calls' host time is inside, as between the piecewise graphs). Prints a table (ms of each
form, absorbed / expanded, the form the CUDA rule picks, both outputs' relative difference, each path's peak of
extra memory) and writes it with the rows, the GPU and the versions as JSON to --out. Also records which of torch's
fused attention backends accept the expanded form's shapes (q/k 192, v 128; causal and lower-right), one small call
each: what scaled_dot_product_attention can pick. Needs a CUDA GPU; no network.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

HEADS = {"deepseek-v2-lite": 16, "deepseek-v3": 128}
NOPE, ROPE, V, RANK, BLOCK = 128, 64, 128, 512, 16
SCALE = (NOPE + ROPE) ** -0.5
CHUNK_QUERIES = 512  # the queries of the chunked-prefill cases
DEVICE = "cuda"  # (a test sets "cpu" to run the plumbing)


def cases(lengths: list[int], cached: tuple[int, ...] = (4096,)) -> list[tuple[str, int, int]]:
    """(name, context_len, query_len) of one sequence: each whole prompt, then the chunk after each count of cached
    tokens."""
    whole = [(f"prompt {n}", n, n) for n in lengths]
    return whole + [(f"chunk {CHUNK_QUERIES} after {n}", n + CHUNK_QUERIES, CHUNK_QUERIES) for n in cached]


def make_inputs(heads: int, context: int, queries: int, gen: torch.Generator, device: str | None = None):
    """q [queries, heads, 192], the latent cache of one sequence in shuffled blocks, its block table, W_UK, W_UV, and
    the dense kv_b weight [heads * (128 + 128), 512] they are rows of (bf16)."""
    blocks = -(-context // BLOCK)
    order = (torch.randperm(blocks, generator=gen) + 1).to(torch.int32)
    cache = torch.randn(blocks + 1, BLOCK, RANK + ROPE, generator=gen).to(torch.bfloat16)
    w_uk = torch.randn(heads, NOPE, RANK, generator=gen) * RANK ** -0.5
    w_uv = torch.randn(heads, V, RANK, generator=gen) * RANK ** -0.5
    kv_b = torch.cat((w_uk, w_uv), dim=1).flatten(0, 1)
    q = torch.randn(queries, heads, NOPE + ROPE, generator=gen)
    tensors = (q, cache, order[None], w_uk, w_uv, kv_b)
    device = device or DEVICE
    return [t.to(device, torch.bfloat16) if t.is_floating_point() else t.to(device) for t in tensors]


def expand_of(kv_b, heads: int):
    """MLAttention.expand over a dense kv_b weight [heads * (128 + 128), 512]: c_kv [n, 512] → (k_nope [n, heads,
    128], v [n, heads, 128])."""
    return lambda c_kv: torch.nn.functional.linear(c_kv, kv_b).view(-1, heads, NOPE + V).split([NOPE, V], dim=-1)


def backends_probe(heads: int) -> dict[str, dict[str, str]]:
    """For each of torch's fused backends alone (sdpa_kernel): whether scaled_dot_product_attention takes the expanded
    form's shapes (q/k 192, v 128, bf16), causal with as many keys as queries and lower-right with more keys ("ok",
    or the error's first line; CausalBias picks its lower-right kernel by torch's checks, recorded too, whatever
    sdpa_kernel allows)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.functional import scaled_dot_product_attention

    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, heads, 64, NOPE + ROPE, generator=gen).to("cuda", torch.bfloat16)
    k = torch.randn(1, heads, 256, NOPE + ROPE, generator=gen).to("cuda", torch.bfloat16)
    v = torch.randn(1, heads, 256, V, generator=gen).to("cuda", torch.bfloat16)
    calls = {"causal": lambda: scaled_dot_product_attention(q, k[:, :, :64], v[:, :, :64], is_causal=True),
             "lower-right": lambda: scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(64, 256))}
    found = {"torch_checks": {}}  # what CausalBias's lower-right dispatch asks before it picks flash or efficient
    for check in ("can_use_flash_attention", "can_use_efficient_attention", "can_use_cudnn_attention"):
        try:
            params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, False)
            found["torch_checks"][check] = bool(getattr(torch.backends.cuda, check)(params))
        except Exception as exc:  # noqa: BLE001 (another torch's signature: recorded)
            found["torch_checks"][check] = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        backend = getattr(SDPBackend, name, None)
        found[name] = {}
        for mask, call in calls.items():
            if backend is None:
                found[name][mask] = "not in this torch"
                continue
            try:
                with sdpa_kernel([backend]):
                    call()
                torch.cuda.synchronize()
                found[name][mask] = "ok"
            except Exception as exc:  # noqa: BLE001 (a backend that refuses: recorded, the others still probed)
                found[name][mask] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
    return found


def run_case(heads: int, context: int, queries: int, reps: int, flush, gen: torch.Generator) -> dict:
    """Both forms' median ms, their outputs' relative difference and each one's peak extra memory (MiB)."""
    from llmc.kernels import mla_attention as mla
    from llmc.kernels.timing import median_time_ms

    q, cache, tables, w_uk, w_uv, kv_b = make_inputs(heads, context, queries, gen)
    expand = expand_of(kv_b, heads)
    context_lens = torch.tensor([context], dtype=torch.int32, device=DEVICE)
    row = {"heads": heads, "context": context, "queries": queries,
           "rule": "expanded" if mla.cuda_expanded_sequences([queries], lambda: [context], heads) else "absorbed"}
    outputs = {}
    for form in mla.FORMS:
        step: dict = {}  # the step's route and row index, made at the first call, as a model's later layers reuse

        def call(form=form, step=step):
            return mla.mla_attention(q, cache, w_uk, w_uv, tables, context_lens, [queries], SCALE,
                                     max_context_len=context, expand=expand, form=form, index_cache=step,
                                     host_context_lens=[context])

        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        outputs[form] = call()
        torch.cuda.synchronize()
        row[f"{form}_peak_mib"] = round((torch.cuda.max_memory_allocated() - before) / 2**20, 1)
        row[f"{form}_ms"] = round(median_time_ms(call, flush, num_warmup=2, num_reps=reps, use_graph=False), 4)
    a, e = outputs["absorbed"].double(), outputs["expanded"].double()
    row["relative_difference"] = float((a - e).norm() / e.norm().clamp(min=1e-30))
    row["absorbed_over_expanded"] = round(row["absorbed_ms"] / row["expanded_ms"], 3)
    return row


def table(rows: list[dict]) -> str:
    lines = ["| shape | case | absorbed ms | expanded ms | absorbed / expanded | rule picks | rel. diff | "
             "peak MiB (abs. / exp.) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['case']} | {r['absorbed_ms']:.3f} | {r['expanded_ms']:.3f} | "
                     f"{r['absorbed_over_expanded']:.2f} | {r['rule']} | {r['relative_difference']:.1e} | "
                     f"{r['absorbed_peak_mib']:.0f} / {r['expanded_peak_mib']:.0f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="the JSON report's path")
    parser.add_argument("--lengths", default="128,512,2048,8192", help="whole-prompt lengths, comma-separated")
    parser.add_argument("--cached", default="4096", help="cached tokens before a 512-query chunk, comma-separated")
    parser.add_argument("--shapes", default=",".join(HEADS), help=f"of {', '.join(HEADS)}, comma-separated")
    parser.add_argument("--reps", type=int, default=7, help="timed calls per form and case (their median)")
    args = parser.parse_args(argv)
    args.lengths = [int(n) for n in args.lengths.split(",")]
    args.cached = tuple(int(n) for n in args.cached.split(","))
    args.shapes = args.shapes.split(",")
    unknown = [s for s in args.shapes if s not in HEADS]
    if unknown:
        parser.error(f"unknown shapes {unknown}: choose from {list(HEADS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("mla_prefill.py times CUDA kernels: no CUDA GPU here", file=sys.stderr)
        return 2
    import triton

    from llmc.kernels import mla_attention as mla
    from llmc.kernels.timing import make_l2_flush_buffer

    flush = make_l2_flush_buffer()
    gen = torch.Generator().manual_seed(0)
    rows, probes = [], {}
    with torch.inference_mode():
        for shape in args.shapes:
            heads = HEADS[shape]
            probes[shape] = backends_probe(heads)
            for case, context, queries in cases(args.lengths, args.cached):
                row = {"shape": shape, "case": case, **run_case(heads, context, queries, args.reps, flush, gen)}
                rows.append(row)
                print(f"{shape:17} {case:22} absorbed {row['absorbed_ms']:9.3f} ms  expanded {row['expanded_ms']:9.3f}"
                      f" ms  (rule: {row['rule']}, rel. diff {row['relative_difference']:.1e})", flush=True)
    report = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(),
        "constants": {"CUDA_EXPAND_MIN_QUERIES": mla.CUDA_EXPAND_MIN_QUERIES, "CUDA_EXPAND_MIN_WORK": mla.CUDA_EXPAND_MIN_WORK,
                      "EXPAND_MAX_KEY_HEADS": mla.EXPAND_MAX_KEY_HEADS, "EXPAND_MAX_KEYS": mla.EXPAND_MAX_KEYS,
                      "EXPAND_MAX_SCORES": mla.EXPAND_MAX_SCORES,
                      "CUDA_EXPAND_MAX_SCORES": mla.CUDA_EXPAND_MAX_SCORES},
        "reps": args.reps, "sdpa_backends": probes, "rows": rows, "table": table(rows),
    }
    print(report["table"])
    print(json.dumps(probes, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
