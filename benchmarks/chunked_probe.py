"""Where the chunked state kernels' time goes (kernels/recurrent_triton.delta_rule_chunked / ssd_chunked), on one GPU:
each kernel alone at Qwen3.5-9B's / Nemotron-H-8B's shapes for one 2048-token piece and 64 pieces of 16, per dot
precision, with the compiled kernels' registers, spills and shared memory.

    source benchmarks/gpu_env.sh && python benchmarks/chunked_probe.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_hybrid import step_pieces, time_calls  # noqa: E402

from llmc.kernels import recurrent_triton as rt  # noqa: E402


def compiled(kernel) -> list[dict]:
    found = []
    for cache in getattr(kernel, "device_caches", {}).values():
        for k in cache[0].values():
            found.append({"regs": getattr(k, "n_regs", None), "spills": getattr(k, "n_spills", None),
                          "shared": k.metadata.shared, "warps": k.metadata.num_warps})
    return found


@torch.inference_mode()
def main() -> None:
    dev = torch.device("cuda")
    for name, lengths in {"1x2048": [2048], "64x16": [16] * 64}.items():
        tokens, cu, slots, fresh = step_pieces(lengths)
        n = len(lengths)
        q = torch.randn(tokens, 2 * 16 * 128, device=dev, dtype=torch.bfloat16)
        v = torch.randn(tokens, 32 * 128, device=dev, dtype=torch.bfloat16)
        g, beta = -torch.rand(tokens, 32, device=dev) * 0.5, torch.rand(tokens, 32, device=dev)
        state = torch.zeros(n, 32, 128, 128, device=dev)
        out = torch.empty(tokens, 32 * 128, device=dev)
        w = torch.empty(tokens, 32 * 128, device=dev)
        u = torch.empty(tokens, 32 * 128, device=dev)
        p = torch.empty(tokens, 32 * 64, device=dev)
        x = torch.randn(tokens, 128 * 64, device=dev, dtype=torch.float32)
        bc = torch.randn(tokens, 2 * 8 * 128, device=dev, dtype=torch.float32)
        dt = torch.rand(tokens, 128, device=dev) * 0.1
        d, a_log = torch.ones(128, device=dev), torch.rand(128, device=dev)
        sstate = torch.zeros(n, 128, 64, 128, device=dev)
        sout = torch.empty(tokens, 128 * 64, device=dev)
        for precision in ("tf32", "tf32x3", "bf16"):  # (4 warps: the dispatch's)
            prep = lambda: rt._delta_rule_prep_kernel[(n, triton.cdiv(max(lengths), 64), 32)](
                q[:, :2048], q[:, 2048:], v, g, beta, w, u, p, cu, q.stride(0), v.stride(0), g.stride(0),
                w.stride(0), u.stride(0), p.stride(0), 2, 128, 128, 128 ** -0.5, 1e-6, 1, C=64, BK=128, BV=128,
                PRECISION=precision, num_warps=4, num_stages=1)
            scan = lambda: rt._delta_rule_scan_kernel[(n, 32, 4)](
                q[:, :2048], q[:, 2048:], g, w, u, p, state, out, cu, slots, fresh, q.stride(0), g.stride(0),
                w.stride(0), u.stride(0), p.stride(0), out.stride(0), state.stride(0), 2, 128, 128, 128 ** -0.5,
                1e-6, 1, C=64, BK=128, BV=32, PRECISION=precision, num_warps=4, num_stages=1)
            ssd = lambda: rt._ssd_chunked_kernel[(n, 128, 2)](
                x, dt, a_log, bc[:, :1024], bc[:, 1024:], d, sstate, sout, cu, slots, fresh, x.stride(0),
                dt.stride(0), bc.stride(0), sout.stride(0), sstate.stride(0), 16, 64, 128, 1, C=64, BP=32,
                BN=128, PRECISION=precision, num_warps=4, num_stages=1)
            row = {"case": name, "precision": precision, "warps": 4}
            for label, fn in (("prep", prep), ("scan", scan), ("ssd", ssd)):
                try:
                    row[label] = round(time_calls(fn, 10), 1)
                except Exception as error:  # noqa: BLE001
                    row[label] = str(error)[:60]
            print(json.dumps(row), flush=True)
    for kernel in (rt._delta_rule_prep_kernel, rt._delta_rule_scan_kernel, rt._ssd_chunked_kernel):
        print(kernel.fn.__name__, json.dumps(compiled(kernel)))


if __name__ == "__main__":
    main()
