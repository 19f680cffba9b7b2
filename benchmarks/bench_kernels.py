"""Kernel speed on the GPU, as ratios against torch's bf16 matmul in the same run (DESIGN §6).

    python benchmarks/bench_kernels.py --tune --out results/      # measure the W4A16 table first
    python benchmarks/bench_kernels.py --table w4a16_table.json   # or use a recorded one
    python benchmarks/bench_kernels.py --tune --tune-ms 128 256 --out results/  # re-measure some M only

Measures, in one run: the two ceilings (device-to-device copy bandwidth, bf16 matmul TFLOP/s at
8192³), then for the Llama-3-8B linear shapes (K × N) and M tokens: torch bf16 F.linear, W4A16 g128
(kernels/w4a16_gemm.py, dispatched by the tuning table), FP8 W8A8 as the format does it today
(torch per-token quantization + torch._scaled_mm) and with the fused Triton quantization
(kernels/fp8.py). Times are CUDA-event medians of CUDA-graph replays with a cold L2 (kernels/timing.py).
Prints a table, writes bench_kernels.json (and w4a16_table.json, w4a16_candidates.json with --tune)
into --out.

    python benchmarks/bench_kernels.py --variants asym-g128-bf16 sym-channel-bf16 sym-g128-fp16 --out results/

also measures W4A16 weights of other kinds ("sym" or "asym" zero points, "g128" or per-"channel" scales,
"bf16" or "fp16" activations) against torch's F.linear in the same activation dtype, and tinygemm where it
takes the weight (bf16, group 128); the default variant sym-g128-bf16 is the full table above.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from llmc.kernels.fp8 import fp8_linear, quantize_fp8_per_token
from llmc.kernels.timing import make_l2_flush_buffer, median_time_ms
from llmc.kernels.w4a16_gemm import pack_w4a16_for_gpu, select_w4a16_config, w4a16_linear
from llmc.quant.formats import Fp8Format
from llmc.quant.numerics import quantize_fp8_per_token as torch_quantize_fp8

SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # (K, N): qkv, o, gate_up, down
MS = [1, 4, 16, 64, 256, 1024, 4096]
GROUP_SIZE = 128


def measure_ceilings(flush) -> dict:
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    copy_ms = median_time_ms(lambda: dst.copy_(src), None, num_reps=10, use_graph=False)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = median_time_ms(lambda: a @ b, None, num_reps=10, use_graph=False)
    return {"copy_GBps": 2 * src.numel() / copy_ms / 1e6, "bf16_matmul_TFLOPs": 2 * 8192**3 / mm_ms / 1e9}


DEFAULT_VARIANT = "sym-g128-bf16"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parse_variant(name: str) -> tuple[bool, int, torch.dtype]:
    """"sym-g128-bf16" → (symmetric, group size (-1 per channel), activation dtype)."""
    parts = name.split("-")
    if len(parts) != 3 or parts[0] not in ("sym", "asym") or parts[1] not in ("g128", "channel") or parts[2] not in DTYPES:
        raise argparse.ArgumentTypeError(f"variant {name!r}: write sym|asym-g128|channel-bf16|fp16, e.g. asym-g128-fp16")
    return parts[0] == "sym", GROUP_SIZE if parts[1] == "g128" else -1, DTYPES[parts[2]]


def make_weights(k: int, n: int, variant: str = DEFAULT_VARIANT) -> dict:
    """The dense (dequantized, in the activation dtype), W4A16 (gpu layout), FP8 and tinygemm versions of
    one random weight [N, K] of the variant's kind."""
    symmetric, group_size, dtype = parse_variant(variant)
    num_groups = 1 if group_size == -1 else k // group_size
    levels = torch.randint(0, 16, (n, k), dtype=torch.int32, device="cuda")
    scales = (torch.rand(n, num_groups, device="cuda") * 0.004 + 0.001).to(dtype)
    zeros = None if symmetric else torch.randint(0, 16, (n, num_groups), dtype=torch.int32, device="cuda")
    w4 = pack_w4a16_for_gpu(levels, scales, zeros)
    columns = k if group_size == -1 else group_size
    zero_levels = 8.0 if zeros is None else zeros.float().repeat_interleave(columns, 1)
    dense = ((levels.float() - zero_levels) * scales.float().repeat_interleave(columns, 1)).to(dtype)
    weights = {"dense": dense, "w4": w4, "group_size": group_size, "num_groups": num_groups, "dtype": dtype,
               "tinygemm": None}
    if dtype == torch.bfloat16 and group_size == GROUP_SIZE:  # what tinygemm takes
        weights["tinygemm"] = tinygemm_weight(levels, scales, zeros)
    if variant == DEFAULT_VARIANT:
        fp8_scale = dense.float().abs().amax(dim=1, keepdim=True) / 448  # [N, 1]
        weights["fp8"] = {"weight": (dense.float() / fp8_scale).to(torch.float8_e4m3fn), "weight_scale": fp8_scale}
    return weights


def tinygemm_weight(levels, scales, zeros=None) -> dict | None:
    """The same weight for torch's int4 kernel (tinygemm, what gpt-fast's int4 runs): two levels per
    byte, then its tiled pack; w = (level - 8) * scale + zero, so our (level - z) * scale has zero
    (8 - z) * scale (0 when symmetric)."""
    try:
        packed = (levels[:, ::2] << 4 | levels[:, 1::2]).to(torch.uint8)  # [N, K / 2]
        weight = torch.ops.aten._convert_weight_to_int4pack(packed, 8)
    except (RuntimeError, TypeError) as exc:  # an older or newer torch signature
        print(f"tinygemm unavailable: {str(exc)[:160]}")
        return None
    tiny_zeros = torch.zeros_like(scales) if zeros is None else ((8 - zeros).to(scales.dtype) * scales)
    scales_and_zeros = torch.stack([scales.t(), tiny_zeros.t()], dim=-1).contiguous()  # [G, N, 2]
    return {"weight": weight, "scales_and_zeros": scales_and_zeros}


def bench_shape(k: int, n: int, ms: list[int], table, flush, variant: str = DEFAULT_VARIANT) -> list[dict]:
    """One shape at every M. "bf16" is torch's F.linear on the dense weight in the variant's activation
    dtype (fp16 for the fp16 variants); the FP8 columns only with the default variant."""
    weights = make_weights(k, n, variant)
    dense, w4, group_size, dtype = weights["dense"], weights["w4"], weights["group_size"], weights["dtype"]
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        runs = {
            "bf16": lambda: F.linear(x, dense),
            "w4a16": lambda: w4a16_linear(x, w4["qweight"], w4["scales"], w4.get("qzeros"), None, group_size, table),
        }
        if "fp8" in weights:
            fp8, fmt = weights["fp8"], Fp8Format(torch.bfloat16)
            runs |= {
                "fp8_torch_quant": lambda: fmt.apply(x, fp8, None),
                "fp8_triton_quant": lambda: fp8_linear(x, fp8["weight"], fp8["weight_scale"], None),
                "quant_torch": lambda: torch_quantize_fp8(x),
                "quant_triton": lambda: quantize_fp8_per_token(x),
            }
        tiny = weights["tinygemm"]
        if tiny is not None:
            runs["tinygemm"] = lambda: torch.ops.aten._weight_int4pack_mm(x, tiny["weight"], GROUP_SIZE, tiny["scales_and_zeros"])
        reference = runs["bf16"]().float()
        errors = {
            name: float((runs[name]().float() - reference).norm() / reference.norm())
            for name in ("w4a16", "fp8_torch_quant", "fp8_triton_quant", "tinygemm") if name in runs
        }
        times = {name: median_time_ms(fn, flush) * 1000 for name, fn in runs.items()}  # µs
        num_groups = weights["num_groups"]
        w4_bytes = n * k // 2 + 2 * n * num_groups + (n * num_groups // 2 if "qzeros" in w4 else 0)
        weight_bytes = {"bf16": 2 * n * k, "w4a16": w4_bytes}
        if "fp8" in weights:
            weight_bytes |= {"fp8_torch_quant": n * k, "fp8_triton_quant": n * k}
        if "tinygemm" in runs:
            weight_bytes["tinygemm"] = n * k // 2 + 4 * n * k // GROUP_SIZE
        row = {"K": k, "N": n, "M": m, "variant": variant,
               "w4a16_config": select_w4a16_config(m, k, n, table, num_sms).to_dict()}
        for name, bytes_w in weight_bytes.items():
            total_bytes = bytes_w + 2 * m * k + 2 * m * n
            row[name] = {
                "us": round(times[name], 2),
                "speedup_vs_bf16": round(times["bf16"] / times[name], 3),
                "GBps": round(total_bytes / times[name] / 1e3, 1),
                "TFLOPs": round(2 * m * n * k / times[name] / 1e6, 1),
                "rel_err_vs_bf16": round(errors.get(name, 0.0), 5),
            }
        if "quant_torch" in times:
            row["quant_us"] = {"torch": round(times["quant_torch"], 2), "triton": round(times["quant_triton"], 2)}
        rows.append(row)
    return rows


def bench_attention(flush) -> list[dict]:
    """Paged attention, Llama-3-8B heads (32 q, 8 kv, head_dim 128), block size 16: Triton vs torch."""
    from llmc.kernels import attention, attention_triton

    rows = []
    cases = {"decode 64 x ctx 1024": ([1024] * 64, [1] * 64), "decode 4 x ctx 8192": ([8192] * 4, [1] * 4),
             "prefill 4 x 1024": ([1024] * 4, [1024] * 4)}
    for name, (context_lens, query_lens) in cases.items():
        blocks_per_seq = max(context_lens) // 16
        num_blocks = blocks_per_seq * len(context_lens)
        k_cache = torch.randn(num_blocks, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        block_tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(len(context_lens), -1)
        q = torch.randn(sum(query_lens), 32, 128, device="cuda", dtype=torch.bfloat16)
        lens = torch.tensor(context_lens, dtype=torch.int32, device="cuda")
        args = (q, k_cache, v_cache, block_tables, lens, query_lens, 128**-0.5, None, max(context_lens))
        ours = attention_triton.paged_attention(*args).float()
        torch_path = lambda: attention.paged_attention(q.cpu(), k_cache.cpu(), v_cache.cpu(), block_tables.cpu(), lens.cpu(), *args[5:])  # noqa: E731
        error = float((ours.cpu() - torch_path().float()).norm() / ours.norm().cpu()) if "8192" not in name else float("nan")
        kv_bytes = 2 * sum(context_lens) * 8 * 128 * 2
        # graph-captured (as the engine's decode steps) only when it is decode-only: a prefill builds
        # its grid's index tensors from host lists each call
        is_decode = all(n == 1 for n in query_lens)
        triton_us = median_time_ms(lambda: attention_triton.paged_attention(*args), flush, use_graph=is_decode) * 1000
        rows.append({"case": name, "triton_us": round(triton_us, 1), "kv_GBps": round(kv_bytes / triton_us / 1e3), "rel_err": error})
        print(rows[-1])
    return rows


def check_decode_attention() -> None:
    """Decode errors against the torch path over sizes and partition counts (bf16 and fp32)."""
    from llmc.kernels import attention, attention_triton

    for num_seqs, context, head_dim, num_partitions, dtype in [
        (64, 1024, 128, 1, torch.bfloat16), (64, 1024, 128, 2, torch.bfloat16), (8, 1024, 128, 1, torch.bfloat16),
        (64, 128, 128, 1, torch.bfloat16), (64, 1024, 64, 1, torch.bfloat16), (64, 1024, 128, 1, torch.float32),
        (3, 100, 32, 1, torch.bfloat16), (3, 100, 128, 1, torch.bfloat16), (16, 1024, 128, 1, torch.bfloat16),
    ]:
        blocks_per_seq = context // 16 + 1
        num_blocks = blocks_per_seq * num_seqs
        k_cache = torch.randn(num_blocks, 16, 8, head_dim, device="cuda", dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        block_tables = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(num_seqs, -1)
        q = torch.randn(num_seqs, 32, head_dim, device="cuda", dtype=dtype)
        lens = torch.full((num_seqs,), context, dtype=torch.int32, device="cuda")
        args = (q, k_cache, v_cache, block_tables, lens, [1] * num_seqs, head_dim**-0.5)
        ours = attention_triton.paged_attention(*args, None, context, num_partitions).float().cpu()
        cpu_args = [t.cpu().double() if t.is_floating_point() else t.cpu() for t in args[:5]]
        expected = attention.paged_attention(*cpu_args, *args[5:]).float()
        bad_rows = ((ours - expected).abs().amax(dim=(1, 2)) > 0.05).nonzero().flatten().tolist()
        print(f"decode check seqs={num_seqs} ctx={context} d={head_dim} parts={num_partitions} {dtype}: "
              f"rel_err {float((ours - expected).norm() / expected.norm()):.2e} bad rows {bad_rows[:12]}")


def kernel_label(config: dict) -> str:
    if config["kind"] == "dequant":
        return "dequant+cuBLAS"
    return (f"{config['kind']}{'-stacked' if config['is_stacked'] else ''} {config['block_m']}x{config['block_n']} "
            f"sk{config['split_k']}" + (f" kt{config['k_tiles']}" if config["kind"] == "rows" else ""))


def print_table(ceilings: dict, rows: list[dict]) -> str:
    lines = [
        f"ceilings: copy {ceilings['copy_GBps']:.0f} GB/s (read + write), bf16 matmul {ceilings['bf16_matmul_TFLOPs']:.0f} TFLOP/s",
        "| K×N | M | bf16 µs | w4a16 µs | ×bf16 | GB/s | TFLOP/s | kernel | tinygemm µs | ×bf16 | fp8 (torch quant) µs | ×bf16 | fp8 (triton quant) µs | ×bf16 | quant torch/triton µs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in (r for r in rows if r["variant"] == DEFAULT_VARIANT):
        w4, f8t, f8n = r["w4a16"], r["fp8_torch_quant"], r["fp8_triton_quant"]
        tiny = r.get("tinygemm", {"us": math.nan, "speedup_vs_bf16": math.nan})
        lines.append(
            f"| {r['K']}×{r['N']} | {r['M']} | {r['bf16']['us']:.1f} | {w4['us']:.1f} | {w4['speedup_vs_bf16']:.2f} | "
            f"{w4['GBps']:.0f} | {w4['TFLOPs']:.1f} | {kernel_label(r['w4a16_config'])} | {tiny['us']:.1f} | {tiny['speedup_vs_bf16']:.2f} | "
            f"{f8t['us']:.1f} | {f8t['speedup_vs_bf16']:.2f} | "
            f"{f8n['us']:.1f} | {f8n['speedup_vs_bf16']:.2f} | {r['quant_us']['torch']:.1f}/{r['quant_us']['triton']:.1f} |"
        )
    others = [r for r in rows if r["variant"] != DEFAULT_VARIANT]
    if others:
        lines += [
            "",
            "| variant | K×N | M | F.linear µs (same dtype) | w4a16 µs | ×F.linear | GB/s | kernel | rel err | tinygemm µs | ×F.linear |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    for r in others:
        w4 = r["w4a16"]
        tiny = r.get("tinygemm", {"us": math.nan, "speedup_vs_bf16": math.nan})
        lines.append(
            f"| {r['variant']} | {r['K']}×{r['N']} | {r['M']} | {r['bf16']['us']:.1f} | {w4['us']:.1f} | "
            f"{w4['speedup_vs_bf16']:.2f} | {w4['GBps']:.0f} | {kernel_label(r['w4a16_config'])} | "
            f"{w4['rel_err_vs_bf16']:.1e} | {tiny['us']:.1f} | {tiny['speedup_vs_bf16']:.2f} |"
        )
    text = "\n".join(lines)
    print(text)
    return text


def merge_tuned(tuned: dict) -> dict:
    """DEFAULT_W4A16_TABLE's entries (as JSON) with those of the M just measured replaced or added."""
    from llmc.kernels.w4a16_gemm import DEFAULT_W4A16_TABLE

    merged = {}
    for shape, entries in tuned.items():
        old = {m: (m, config.to_dict(), us) for m, config, us in DEFAULT_W4A16_TABLE.get(shape, ())}
        merged[shape] = sorted((old | {m: (m, config, us) for m, config, us in entries}).values())
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--tune", action="store_true", help="measure the W4A16 tuning table first")
    parser.add_argument("--table", type=Path, help="a W4A16 tuning table (JSON) to use")
    parser.add_argument("--ms", type=int, nargs="*", default=MS)
    parser.add_argument("--tune-ms", type=int, nargs="+", default=None,
                        help="with --tune: measure only these M and keep DEFAULT_W4A16_TABLE's other entries")
    parser.add_argument("--variants", nargs="+", default=[DEFAULT_VARIANT],
                        help=f"W4A16 weight kinds to measure (default {DEFAULT_VARIANT}, with the FP8 columns and attention)")
    args = parser.parse_args()
    for variant in args.variants:
        try:
            parse_variant(variant)
        except argparse.ArgumentTypeError as exc:
            parser.error(str(exc))
    args.out.mkdir(parents=True, exist_ok=True)
    flush = make_l2_flush_buffer()
    with_default = DEFAULT_VARIANT in args.variants
    if with_default:
        check_decode_attention()
    ceilings = measure_ceilings(flush)
    table = None
    if args.tune:
        from llmc.kernels.w4a16_tune import tune_w4a16

        records = []
        if args.tune_ms:
            table = merge_tuned(tune_w4a16(SHAPES, ms=tuple(args.tune_ms), records=records))
        else:
            table = tune_w4a16(SHAPES, records=records)
        (args.out / "w4a16_table.json").write_text(json.dumps(table, indent=1))
        (args.out / "w4a16_candidates.json").write_text(json.dumps(records))
    elif args.table:
        table = json.loads(args.table.read_text())
    rows = [row for variant in args.variants for k, n in SHAPES for row in bench_shape(k, n, args.ms, table, flush, variant)]
    attention_rows = bench_attention(flush) if with_default else []
    text = print_table(ceilings, rows)
    device = torch.cuda.get_device_name(0)
    result = {"device": device, "torch": torch.__version__, "ceilings": ceilings, "rows": rows, "table": text,
              "attention": attention_rows}
    (args.out / "bench_kernels.json").write_text(json.dumps(result, indent=1))
    for variant in args.variants:
        ratios = [(r["M"], r["w4a16"]["speedup_vs_bf16"]) for r in rows if r["variant"] == variant]
        print(f"device: {device}; {variant}: worst w4a16 ×F.linear {min(x for _, x in ratios):.2f}; "
              f"M<=16 min: {min((x for m, x in ratios if m <= 16), default=math.nan):.2f}")


if __name__ == "__main__":
    main()
