"""The hybrid models' state layers on one GPU: each layer's forward on its torch ops (the CPU's path) against its Triton
kernels (kernels/recurrent.py), same run, same weights and inputs.

    source benchmarks/gpu_env.sh && python benchmarks/bench_hybrid.py [--json OUT.json] [--layers deltanet mamba2 short_conv]
    TRITON_INTERPRET=1 python benchmarks/bench_hybrid.py --tiny   # a check of this script on a CPU (no timing worth reading)

Layers at published shapes, bf16, random weights:
  deltanet    Qwen3.5-9B's Gated DeltaNet (transformers' Qwen3_5TextConfig defaults: hidden 4096, 16 key heads and 32
              value heads of 128, conv 4): 2 MiB of float32 state per sequence (1 MiB with --state-dtype bfloat16)
  mamba2      Nemotron-H-8B's Mamba-2 mixer (hidden 4096, 128 heads of 64, 8 groups, d_state 128, conv 4): 4 MiB
  short_conv  LFM2-1.2B's gated short conv (hidden 2048, 3 taps)

Decode steps of B sequences (1, 64, 256; each continuing from its own slot's state) are captured in a CUDA graph and
timed by replays (median of 50 replays after 5); prefill steps (one sequence of 2048 tokens; 16 sequences of 256;
256 one-token sequences beside one of 512, a mixed step; each from zero state) eagerly (median of 10 after 2), on
the kernels also with every piece on the token loop (`triton_loop`: kernels/recurrent.CHUNKED_FROM out of reach, the
form before the chunked kernels). Both paths start each timing from the same states; the printed `max_diff` is the
largest difference of the two paths' outputs on the first step (they differ by rounding order, and by tf32's
rounding on the chunked kernels). The in- and out-projections are part of each layer's time, as in a model's step.
`--sweep-chunked` times the chunked kernels alone per tile against the token loop; `--profile` lists the prefills'
CUDA kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch

from llmc.kernels import recurrent
from llmc.quant.formats import DenseFormat
from llmc.runtime.forward_batch import ForwardBatch
from llmc.runtime.models.gated_deltanet import GatedDeltaNet
from llmc.runtime.models.mamba2 import Mamba2
from llmc.runtime.models.short_conv import ShortConv

CONFIGS = {
    "deltanet": (GatedDeltaNet, dict(hidden_size=4096, linear_num_key_heads=16, linear_num_value_heads=32,
                                     linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                                     rms_norm_eps=1e-6, linear_norm_eps=None, linear_allow_neg_eigval=False)),
    "mamba2": (Mamba2, dict(hidden_size=4096, mamba_num_heads=128, mamba_head_dim=64, mamba_n_groups=8,
                            mamba_d_state=128, mamba_conv_dim=128 * 64 + 2 * 8 * 128, mamba_conv_kernel=4,
                            mamba_chunk_size=128, rms_norm_eps=1e-5, mamba_conv_bias=True, mamba_rms_norm=True)),
    "short_conv": (ShortConv, dict(hidden_size=2048, short_conv_kernel=3)),
}
DECODE_BATCHES = (1, 64, 256)
PREFILLS = {"1x2048": [2048], "16x256": [256] * 16, "256x1+512": [1] * 256 + [512]}  # (the last: a mixed step)
TINY = {"deltanet": dict(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                         linear_value_head_dim=16),
        "mamba2": dict(hidden_size=64, mamba_num_heads=4, mamba_head_dim=8, mamba_n_groups=2, mamba_d_state=16,
                       mamba_conv_dim=4 * 8 + 2 * 2 * 16, mamba_chunk_size=8),
        "short_conv": dict(hidden_size=64)}
DEVICE = "cuda"
STATE_DTYPE = torch.float32  # the recurrent states' (--state-dtype: runtime.mamba_ssm_cache_dtype's)


def shrink() -> None:
    """--tiny: small widths, batches and prefills, on the CPU (the kernels interpreted), decode steps eager."""
    global DECODE_BATCHES, PREFILLS, DEVICE
    for kind, values in TINY.items():
        CONFIGS[kind][1].update(values)
    DECODE_BATCHES, PREFILLS, DEVICE = (1, 3), {"1x70": [70], "3x7": [7] * 3, "3x1+70": [1, 1, 1, 70]}, "cpu"


def make_layer(kind: str, dtype: torch.dtype, slots: int):
    cls, values = CONFIGS[kind]
    formats = defaultdict(lambda: DenseFormat(dtype))
    layer = cls(SimpleNamespace(**values), formats, 0, dtype).to_empty(device=DEVICE)
    generator = torch.Generator(DEVICE).manual_seed(0)
    for name, buffer in layer.named_buffers():
        if name.endswith("A_log"):
            buffer.uniform_(0.0, 2.7, generator=generator)  # A in [-15, -1]: Mamba's init range
        elif name.endswith(("norm.weight", "D.weight")):
            buffer.fill_(1.0)
        else:
            buffer.normal_(0.0, 0.02, generator=generator)
    layer.bind_states(slots, torch.device(DEVICE), (dtype, STATE_DTYPE))
    for state in layer.states():
        state.normal_(0.0, 0.1, generator=generator)
    return layer


def batch_of(query_lens: list[int], context_lens: list[int], slots: list[int]) -> ForwardBatch:
    device = torch.device(DEVICE)
    tokens = sum(query_lens)
    return ForwardBatch(
        positions=torch.zeros(tokens, dtype=torch.int64, device=device),
        slot_mapping=torch.zeros(tokens, dtype=torch.int64, device=device),
        block_tables=torch.zeros(len(query_lens), 1, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device), query_lens=list(query_lens),
        max_context_len=max(context_lens), logits_indices=torch.zeros(1, dtype=torch.int64, device=device),
        host_context_lens=list(context_lens), state_slots=torch.tensor(slots, dtype=torch.int64, device=device))


def states_of(layer) -> list[torch.Tensor]:
    return list(layer.states())


def use_kernels(on: bool) -> None:
    recurrent.can_use_triton = lambda *tensors: on


def time_decode(layer, batch_size: int, x: torch.Tensor) -> tuple[float, torch.Tensor]:
    """µs per replay of a CUDA graph of one decode step of batch_size sequences (slots 0..B-1, 100 tokens in)."""
    batch = batch_of([1] * batch_size, [100] * batch_size, list(range(batch_size)))
    saved = [t.clone() for t in states_of(layer)]
    first = layer(x, batch).clone()
    if DEVICE == "cpu":
        for t, s in zip(states_of(layer), saved):
            t.copy_(s)
        return 0.0, first
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            layer(x, batch)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer(x, batch)
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(50):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    for t, s in zip(states_of(layer), saved):
        t.copy_(s)
    return statistics.median(times), first


def time_prefill(layer, lengths: list[int], x: torch.Tensor) -> tuple[float, torch.Tensor]:
    """µs per eager forward of one step of fresh sequences of these lengths."""
    batch = batch_of(lengths, lengths, list(range(len(lengths))))
    first = layer(x, batch).clone()
    if DEVICE == "cpu":
        return 0.0, first
    times = []
    for i in range(12):
        batch.kernel_cache.clear()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        layer(x, batch)
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times), first


@torch.inference_mode()
def bench_layer(kind: str, dtype: torch.dtype) -> list[dict]:
    layer = make_layer(kind, dtype, max(DECODE_BATCHES) + 1)
    hidden = CONFIGS[kind][1]["hidden_size"]
    generator = torch.Generator(DEVICE).manual_seed(1)
    rows = []
    cases = [("decode", f"B={b}", b, None) for b in DECODE_BATCHES]
    cases += [("prefill", name, sum(lengths), lengths) for name, lengths in PREFILLS.items()]
    for phase, name, tokens, lengths in cases:
        x = torch.randn(tokens, hidden, device=DEVICE, dtype=dtype, generator=generator)
        result = {"layer": kind, "phase": phase, "case": name}
        outputs = {}
        paths = [("torch", False, recurrent.CHUNKED_FROM), ("triton", True, recurrent.CHUNKED_FROM)]
        if phase == "prefill":  # the kernels' token loop where the chunked kernels would run (the form before them)
            paths.append(("triton_loop", True, 1 << 30))
        for path, on, chunked_from in paths:
            use_kernels(on)
            default, recurrent.CHUNKED_FROM = recurrent.CHUNKED_FROM, chunked_from
            us, outputs[path] = time_decode(layer, tokens, x) if phase == "decode" else time_prefill(layer, lengths, x)
            recurrent.CHUNKED_FROM = default
            result[f"{path}_us"] = round(us, 1)
        result["speedup"] = round(result["torch_us"] / max(result["triton_us"], 1e-9), 2)
        if phase == "prefill":
            result["chunked_speedup"] = round(result["triton_loop_us"] / max(result["triton_us"], 1e-9), 2)
            result["loop_max_diff"] = float((outputs["triton_loop"].float() - outputs["triton"].float()).abs().max())
        result["max_diff"] = float((outputs["torch"].float() - outputs["triton"].float()).abs().max())
        result["out_abs_max"] = float(outputs["torch"].float().abs().max())
        print(json.dumps(result), flush=True)
        rows.append(result)
    return rows


DELTA_CONFIGS = [(16, 1), (32, 1), (16, 2), (32, 2), (32, 4), (64, 4), (64, 8), (128, 8)]  # (block_v, num_warps)
SSD_CONFIGS = [(4, 1), (8, 1), (8, 2), (16, 2), (16, 4), (32, 4), (32, 8), (64, 8)]  # (block_p, num_warps)


def time_calls(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times)


def step_pieces(lengths: list[int]):
    """A step's sequences for the kernels from their lengths: (tokens, cu_seqlens, slots 0..n-1, fresh all false)."""
    device, n = torch.device(DEVICE), len(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return sum(lengths), cu, torch.arange(n, device=device), torch.zeros(n, dtype=torch.bool, device=device)


@torch.inference_mode()
def sweep() -> list[dict]:
    """The delta rule's and the SSD recurrence's kernels alone (eager launches, µs, median of 20) per tile and warp
    count, at Qwen3.5-9B's and Nemotron-H-8B's shapes: decode steps of 1 and 256 sequences, prefills 1x2048, 16x256."""
    from llmc.kernels import recurrent_triton

    rows, device = [], torch.device(DEVICE)
    cases = {"B=1": [1], "B=256": [1] * 256, "1x2048": [2048], "16x256": [256] * 16}
    for name, lengths in cases.items():
        tokens, cu, slots, fresh = step_pieces(lengths)
        n = len(lengths)
        q = torch.randn(tokens, 2 * 16 * 128, device=device, dtype=torch.bfloat16)
        v = torch.randn(tokens, 32 * 128, device=device, dtype=torch.bfloat16)
        raw = max(lengths) == 1  # (kernels/recurrent.GATES_IN_KERNEL: a decode's gates raw, a prefill's computed)
        ab = torch.randn(tokens, 64, device=device, dtype=torch.bfloat16 if raw else torch.float32)
        a_log, dt_bias = torch.rand(32, device=device), torch.randn(32, device=device)
        state = torch.zeros(n, 32, 128, 128, device=device, dtype=STATE_DTYPE)
        out = torch.empty(tokens, 32 * 128, device=device)
        for block_v, warps in DELTA_CONFIGS:
            us = time_calls(lambda: recurrent_triton.delta_rule(
                q[:, :2048], q[:, 2048:], v, ab[:, :32], ab[:, 32:], a_log, dt_bias, 1.0, state, slots, fresh, cu,
                128 ** -0.5, 1e-6, out, block_v, warps, raw))
            rows.append({"kernel": "delta_rule", "case": name, "block": block_v, "warps": warps, "us": round(us, 1),
                         "state_dtype": str(STATE_DTYPE)[6:],
                         "state_GBps": round(2 * state.nbytes / us / 1e3, 1)})
            print(json.dumps(rows[-1]), flush=True)
        del state, out
        x = torch.randn(tokens, 128 * 64, device=device, dtype=torch.float32)
        bc = torch.randn(tokens, 2 * 8 * 128, device=device, dtype=torch.float32)
        dt = torch.randn(tokens, 128, device=device, dtype=torch.bfloat16 if raw else torch.float32)
        d = torch.ones(128, device=device)
        dt_bias, a_log = torch.randn(128, device=device), torch.rand(128, device=device)
        state = torch.zeros(n, 128, 64, 128, device=device, dtype=STATE_DTYPE)
        out = torch.empty(tokens, 128 * 64, device=device)
        for block_p, warps in SSD_CONFIGS:
            us = time_calls(lambda: recurrent_triton.ssd(x, dt, dt_bias, a_log, bc[:, :1024], bc[:, 1024:], d, state,
                                                         slots, fresh, cu, out, block_p, warps, raw))
            rows.append({"kernel": "ssd", "case": name, "block": block_p, "warps": warps, "us": round(us, 1),
                         "state_dtype": str(STATE_DTYPE)[6:],
                         "state_GBps": round(2 * state.nbytes / us / 1e3, 1)})
            print(json.dumps(rows[-1]), flush=True)
        del state, out
    return rows


# (block_v or block_p, num_warps, num_stages); 8 warps (fewer spills) were slower in every case (session 54)
CHUNKED_DELTA_CONFIGS = [(32, 4, 1), (64, 4, 1), (32, 8, 1), (64, 8, 1)]
CHUNKED_SSD_CONFIGS = [(32, 4, 1), (64, 4, 1), (32, 8, 1), (64, 8, 1)]
CROSSOVER = {"1x2048": [2048], "16x256": [256] * 16, "64x64": [64] * 64, "64x32": [32] * 64, "64x16": [16] * 64,
             "256+1x512": [1] * 256 + [512]}


def _timed_cases(kernel: str, name: str, cases) -> list[dict]:
    """One row per (form, block, warps, fn) case: its µs, or the compiler's refusal (a config beyond the GPU's shared
    memory)."""
    rows = []
    for form, block, warps, fn in cases:
        try:
            us = round(time_calls(fn), 1)
        except Exception as error:  # noqa: BLE001 (triton's OutOfResources and the like: the config cannot run here)
            us = f"{type(error).__name__}: {str(error)[:80]}"
        rows.append({"kernel": kernel, "form": form, "case": name, "block": block, "warps": warps, "us": us})
        print(json.dumps(rows[-1]), flush=True)
    return rows


@torch.inference_mode()
def sweep_chunked() -> list[dict]:
    """The chunked kernels (kernels/recurrent_triton.delta_rule_chunked, ssd_chunked) per tile and warp count, and the
    token loop at its prefill tile beside them, at Qwen3.5-9B's and Nemotron-H-8B's shapes over prefills of several
    piece lengths (CROSSOVER: where kernels/recurrent.CHUNKED_FROM should sit); eager launches, µs, median of 20."""
    from llmc.kernels import recurrent_triton

    rows, device = [], torch.device(DEVICE)
    for name, lengths in CROSSOVER.items():
        tokens, cu, slots, fresh = step_pieces(lengths)
        n = len(lengths)
        q = torch.randn(tokens, 2 * 16 * 128, device=device, dtype=torch.bfloat16)
        v = torch.randn(tokens, 32 * 128, device=device, dtype=torch.bfloat16)
        g = -torch.rand(tokens, 32, device=device) * 0.5
        beta = torch.rand(tokens, 32, device=device)
        a_log, dt_bias = torch.rand(32, device=device), torch.randn(32, device=device)
        state = torch.zeros(n, 32, 128, 128, device=device, dtype=STATE_DTYPE)
        out = torch.empty(tokens, 32 * 128, device=device)
        block, warps = recurrent.DELTA_RULE_TILES["prefill"]
        cases = [("loop", block, warps, lambda: recurrent_triton.delta_rule(
            q[:, :2048], q[:, 2048:], v, g, beta, a_log, dt_bias, 1.0, state, slots, fresh, cu, 128 ** -0.5, 1e-6,
            out, block, warps, False))]
        cases += [(f"chunked/{st}", bv, w, lambda bv=bv, w=w, st=st: recurrent_triton.delta_rule_chunked(
            q[:, :2048], q[:, 2048:], v, g, beta, state, slots, fresh, cu, 128 ** -0.5, 1e-6, out, max(lengths), 1,
            bv, w, st)) for bv, w, st in CHUNKED_DELTA_CONFIGS]
        rows += _timed_cases("delta_rule", name, cases)
        del state, out, q, v
        x = torch.randn(tokens, 128 * 64, device=device, dtype=torch.bfloat16)
        bc = torch.randn(tokens, 2 * 8 * 128, device=device, dtype=torch.bfloat16)
        dt = torch.rand(tokens, 128, device=device) * 0.1
        d = torch.ones(128, device=device)
        state = torch.zeros(n, 128, 64, 128, device=device, dtype=STATE_DTYPE)
        out = torch.empty(tokens, 128 * 64, device=device)
        block, warps = recurrent.SSD_TILES["prefill"]
        cases = [("loop", block, warps, lambda: recurrent_triton.ssd(
            x, dt, dt_bias, a_log, bc[:, :1024], bc[:, 1024:], d, state, slots, fresh, cu, out, block, warps, False))]
        cases += [(f"chunked/{st}", bp, w, lambda bp=bp, w=w, st=st: recurrent_triton.ssd_chunked(
            x, dt, a_log, bc[:, :1024], bc[:, 1024:], d, state, slots, fresh, cu, out, 1, bp, w, st))
            for bp, w, st in CHUNKED_SSD_CONFIGS]
        rows += _timed_cases("ssd", name, cases)
        del state, out, x
    return rows


@torch.inference_mode()
def profile_prefills(kinds: list[str]) -> list[dict]:
    """Each layer's prefill steps on the kernels under torch.profiler (after a warm-up): its CUDA kernels by total
    time per step (µs), the longest first."""
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for kind in kinds:
        layer = make_layer(kind, torch.bfloat16, max(len(lengths) for lengths in PREFILLS.values()) + 1)
        use_kernels(True)
        for name, lengths in PREFILLS.items():
            x = torch.randn(sum(lengths), CONFIGS[kind][1]["hidden_size"], device=DEVICE, dtype=torch.bfloat16)
            batch = batch_of(lengths, lengths, list(range(len(lengths))))
            for _ in range(2):
                batch.kernel_cache.clear()
                layer(x, batch)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    batch.kernel_cache.clear()
                    layer(x, batch)
                torch.cuda.synchronize()
            kernels = sorted(((e.key, e.device_time_total / 5, e.count / 5) for e in prof.key_averages()
                              if e.device_time_total > 0), key=lambda row: -row[1])
            row = {"layer": kind, "case": name, "kernel_us": round(sum(k[1] for k in kernels), 1),
                   "kernels": [{"name": k[0][:60], "us": round(k[1], 1), "calls": k[2]} for k in kernels[:12]]}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--tiny", action="store_true", help="check this script on a CPU (TRITON_INTERPRET=1)")
    parser.add_argument("--sweep", action="store_true", help="only the kernels' tiles and warps (`sweep`)")
    parser.add_argument("--profile", action="store_true", help="only the prefills' CUDA kernels (`profile_prefills`)")
    parser.add_argument("--sweep-chunked", action="store_true",
                        help="only the chunked kernels' tiles and warps against the token loop (`sweep_chunked`)")
    parser.add_argument("--state-dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="the recurrent states' dtype (runtime.mamba_ssm_cache_dtype); conv states: the layer's")
    args = parser.parse_args(argv)
    global STATE_DTYPE
    STATE_DTYPE = getattr(torch, args.state_dtype)
    if args.tiny:
        shrink()
    if args.profile:
        result = profile_prefills(args.layers)
        if args.json:
            args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "profile": result}, indent=2))
        return
    if args.sweep or args.sweep_chunked:
        result = sweep() if args.sweep else sweep_chunked()
        if args.json:
            args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "state_dtype": args.state_dtype,
                                             "sweep": result}, indent=2))
        return
    rows = [row for kind in args.layers for row in bench_layer(kind, torch.bfloat16)]
    print(f"{'layer':11} {'phase':8} {'case':8} {'torch µs':>10} {'triton µs':>10} {'speed-up':>9} {'max diff':>9} "
          f"{'loop µs':>10} {'chunked ×':>9}")
    for r in rows:
        print(f"{r['layer']:11} {r['phase']:8} {r['case']:8} {r['torch_us']:>10} {r['triton_us']:>10} "
              f"{r['speedup']:>9} {r['max_diff']:>9.2e} {r.get('triton_loop_us', ''):>10} "
              f"{r.get('chunked_speedup', ''):>9}")
    if args.json:
        device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
        args.json.write_text(json.dumps({"device": device, "state_dtype": args.state_dtype, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
