"""The MLP part of a decode step on the GPU, with SiLU · mul in gate_up's W4A16 GEMV epilogue and as a
kernel of its own, in one process: for every layer of a Llama-3-8B-shaped model (32 layers, hidden
4096, intermediate 14336, RTN-like random int4 weights, group 128, bf16), the residual add + RMSNorm,
gate_up → SiLU · mul → down as the model runs them (MLP.forward; the gate_up rows interleaved as the
loader leaves them), captured in one CUDA graph, cold L2 before each replay, median of 25 replays
(kernels/timing.py).

    source benchmarks/gpu_env.sh && python benchmarks/mlp_step_bench.py [--ms 1,4,8,16,32] [--json OUT.json]

"separate": w4a16_linear(gate_up) then activation.silu_and_mul (the interleaved order), then down;
"fused": w4a16_silu_mul(gate_up) (the epilogue where the kernel is kind wgmma), then down; "fused-early":
the same with w4a16_gluon.SILU_MUL_LATE_DEPENDENTS off (the down GEMV launched at gate_up's start).
Both run the default kernel table's configs, with programmatic dependent launch as the engine has it.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from llmc.kernels import activation, norm, w4a16_gluon
from llmc.kernels.timing import make_l2_flush_buffer, median_time_ms
from llmc.kernels.w4a16_gemm import interleave_gate_up, pack_w4a16_for_gpu, w4a16_linear, w4a16_silu_mul

NUM_LAYERS, HIDDEN, INTERMEDIATE, GROUP = 32, 4096, 14336, 128
VARIANTS = ("separate", "fused", "fused-early")


def random_linear(k: int, n: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Packed on the GPU (a CPU packs 32 layers' 7 billion levels too slowly)."""
    levels = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32, device="cuda")
    scales = (torch.rand(n, k // GROUP, generator=gen, device="cuda") * 0.004 + 0.001).to(torch.bfloat16)
    return pack_w4a16_for_gpu(levels, scales, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ms", default="1,4,8,16,32")
    parser.add_argument("--json")
    args = parser.parse_args()
    gen = torch.Generator("cuda").manual_seed(0)
    layers = [(interleave_gate_up(random_linear(HIDDEN, 2 * INTERMEDIATE, gen)), random_linear(INTERMEDIATE, HIDDEN, gen))
              for _ in range(NUM_LAYERS)]
    flush = make_l2_flush_buffer()
    norm_weight = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)

    def step(x, residual, variant):
        """Per layer: the residual add + RMSNorm before the MLP (as post_attn_norm runs it), then the MLP."""
        for gate_up, down in layers:
            h, residual = norm.add_rms_norm(x, residual, norm_weight, 1e-5)
            gu = (gate_up["qweight"], gate_up["scales"], None, None, GROUP)
            h = (activation.silu_and_mul(w4a16_linear(h, *gu), activation.GATE_UP_INTERLEAVE) if variant == "separate"
                 else w4a16_silu_mul(h, *gu))
            x = w4a16_linear(h, down["qweight"], down["scales"], None, None, GROUP)
        return x

    rows = []
    for m in [int(v) for v in args.ms.split(",")]:
        x = torch.randn(m, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16) * 0.1
        residual = torch.randn(m, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
        # the same bits either way: one layer's SiLU · mul output, layer by layer on the same input
        mismatched = []
        for gate_up, _ in layers[:4]:
            gu = (gate_up["qweight"], gate_up["scales"], None, None, GROUP)
            fused = w4a16_silu_mul(x, *gu)
            separate = activation.silu_and_mul(w4a16_linear(x, *gu), activation.GATE_UP_INTERLEAVE)
            mismatched.append(int((fused != separate).sum()))
        print(f"M={m}: elements of SiLU · mul that differ, first 4 layers: {mismatched}", flush=True)
        us = {}
        for variant in VARIANTS:
            w4a16_gluon.SILU_MUL_LATE_DEPENDENTS = variant != "fused-early"
            us[variant] = 1e3 * median_time_ms(lambda: step(x, residual, variant), flush)
        w4a16_gluon.SILU_MUL_LATE_DEPENDENTS = True
        rows.append({"m": m, **{f"{name}_us": round(v, 1) for name, v in us.items()}, "mismatched": mismatched})
        print(f"M={m}: " + ", ".join(f"{name} {v:.1f} µs ({v / us['separate']:.3f}x)" for name, v in us.items()),
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "argv": sys.argv[1:], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
