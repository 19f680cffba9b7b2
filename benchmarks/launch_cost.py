"""Host time per call of the kernels an eager (prefill or mixed) step launches, without a profiler.

    source benchmarks/gpu_env.sh && R=$PWD && cd /tmp && python $R/benchmarks/launch_cost.py --json $OUT/launch_cost.json

Each entry point is called --calls times in a row while the GPU is kept busy (torch.cuda._sleep queued
ahead), so no call waits for the device: perf_counter over the loop / calls is the host's cost of one
call, Python and launch, as an eager step pays it (benchmarks/prefill_host.py shows TTFT of one short
request at 3-13x its kernel time). Shapes are Llama-3-8B's o projection (4096 x 4096) and gate_up.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import make_weights  # noqa: E402

from llmc.kernels.activation import silu_and_mul  # noqa: E402
from llmc.kernels.fp8 import fp8_linear  # noqa: E402
from llmc.kernels.norm_triton import rms_norm  # noqa: E402
from llmc.kernels.w4a16_gemm import w4a16_linear, w4a16_silu_mul  # noqa: E402

SLEEP_CYCLES = 2_000_000_000  # ~1 s at the SM clock: longer than any loop below


def host_us(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def profile_calls(calls: int) -> None:
    import cProfile
    import pstats

    o = make_weights(4096, 4096)
    w4, fp8 = o["w4"], o["fp8"]
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    for name, fn in [("w4a16_linear", lambda: w4a16_linear(x, w4["qweight"], w4["scales"], None, None, 128)),
                     ("fp8_linear", lambda: fp8_linear(x, fp8["weight"], fp8["weight_scale"], None)),
                     ("rms_norm", lambda: rms_norm(x, weight, 1e-5, x))]:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            fn()
        profiler.disable()
        torch.cuda.synchronize()
        rows = sorted(pstats.Stats(profiler).stats.items(), key=lambda item: item[1][2], reverse=True)
        print(f"== {name}: {sum(r[1][2] for r in rows) / calls * 1e6:.1f} µs per call under cProfile")
        for (path, line, func), (cc, nc, tt, ct, _) in rows[:30]:
            print(f"  own {tt / calls * 1e6:7.1f} µs  cum {ct / calls * 1e6:7.1f} µs  calls {nc / calls:5.1f}  "
                  f"{Path(path).name}:{line}:{func}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 16, 128, 512])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--profile", action="store_true",
                        help="instead: cProfile of --calls calls of w4a16_linear, fp8_linear and rms_norm at 16 tokens "
                             "(the functions by own time, µs per call)")
    args = parser.parse_args()
    if args.profile:
        return profile_calls(args.calls)
    o, gate_up = make_weights(4096, 4096), make_weights(4096, 28672)
    results = {}

    def record(name: str, fn) -> None:
        results[name] = round(host_us(fn, args.calls), 1)
        print(f"{name}: {results[name]} µs per call", flush=True)

    for m in args.ms:
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        w4, w4g = o["w4"], gate_up["w4"]
        record(f"F.linear 4096x4096 M={m}", lambda: F.linear(x, o["dense"]))
        record(f"w4a16_linear 4096x4096 M={m}", lambda: w4a16_linear(x, w4["qweight"], w4["scales"], None, None, 128))
        record(f"w4a16_silu_mul 4096x28672 M={m}",
               lambda: w4a16_silu_mul(x, w4g["qweight"], w4g["scales"], None, None, 128))
        fp8 = o["fp8"]
        record(f"fp8_linear 4096x4096 M={m}", lambda: fp8_linear(x, fp8["weight"], fp8["weight_scale"], None))
        weight = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
        record(f"rms_norm (Triton) M={m}", lambda: rms_norm(x, weight, 1e-5, x))
        y = torch.randn(m, 2 * 4096, device="cuda", dtype=torch.bfloat16)
        record(f"silu_and_mul M={m}", lambda: silu_and_mul(y))
    # the parts of one w4a16_linear call at 16 tokens besides the kernel launch itself
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from llmc.kernels.split_k_triton import plan_splits
    from llmc.kernels.w4a16_gemm import select_w4a16_config

    x16 = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    record("  part: select_w4a16_config", lambda: select_w4a16_config(16, 4096, 4096, None, num_sms))
    record("  part: plan_splits (4 splits, counters)", lambda: plan_splits(32, 4, 16, 4096, x16, x16.dtype, 64, 16))
    record("  part: two NVMMASharedLayout.get_default_for", lambda: (
        gl.NVMMASharedLayout.get_default_for([16, 64], gl.bfloat16), gl.NVMMASharedLayout.get_default_for([16, 128], gl.int32)))
    layout = gl.NVMMASharedLayout.get_default_for([16, 64], gl.bfloat16)
    record("  part: one TensorDescriptor", lambda: TensorDescriptor(x16, list(x16.shape), list(x16.stride()), [16, 64], layout))
    record("torch.empty", lambda: torch.empty(16, 4096, device="cuda", dtype=torch.bfloat16))
    record("x.add_(1) (one torch kernel)", lambda: x.add_(1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                                         "host_us_per_call": results}, indent=1))


if __name__ == "__main__":
    main()
