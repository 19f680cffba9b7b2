"""Registers, spilled bytes and shared memory of the chunked state kernels (kernels/recurrent_triton.py) compiled for
sm_90 by the installed triton and its bundled ptxas, at Qwen3.5-9B's / Nemotron-H-8B's head sizes (key and value dims
128; head_dim 64, d_state 128), per tile and warp count: facts of the compiled code, no GPU needed (what a run costs
is the GPU's to say: bench_hybrid.py --sweep-chunked).

    env -u TRITON_INTERPRET python benchmarks/chunked_spills.py
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from llmc.kernels import recurrent_triton as rt

TILE_NAMES = ("C", "BK", "BV", "BP", "BN", "PRECISION")
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
SEQS = {"cu_ptr": "*i32", "slot_ptr": "*i64", "fresh_ptr": "*i1"}
QK = {"q_ptr": "*bf16", "k_ptr": "*bf16"}


def facts(fn, pointers: dict, floats: tuple, constants: dict, warps: int, stages: int = 1) -> str:
    signature = {n: pointers.get(n, "*fp32") if n.endswith("_ptr") else "fp32" if n in floats else "i32"
                 for n in fn.arg_names if n not in TILE_NAMES}
    names = list(fn.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items() if t.startswith("*")}
    source = ASTSource(fn, {**signature, **{c: "constexpr" for c in constants}}, constants, attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": stages})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    log = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                         text=True).stderr
    os.unlink(f.name)
    registers = re.search(r"Used (\d+) registers", log).group(1)
    spilled = re.search(r"(\d+) bytes spill stores", log).group(1)
    return f"registers {registers}, spill stores {spilled} B, shared {kernel.metadata.shared} B"


def main() -> None:
    shapes = {"C": 64, "PRECISION": rt.DOT_PRECISION}
    for warps in (4, 8):
        print("delta rule, per-chunk kernel", warps, "warps:",
              facts(rt._delta_rule_prep_kernel, {**QK, **SEQS, "v_ptr": "*bf16"}, ("scale", "eps"),
                    {**shapes, "BK": 128, "BV": 128}, warps), flush=True)
    for block_v in (32, 64):
        for warps in (4, 8):
            print("delta rule, scan, tile", block_v, warps, "warps:",
                  facts(rt._delta_rule_scan_kernel, {**QK, **SEQS}, ("scale", "eps"),
                        {**shapes, "BK": 128, "BV": block_v}, warps), flush=True)
    for block_p in (32, 64):
        for warps in (4, 8):
            print("SSD, tile", block_p, warps, "warps:",
                  facts(rt._ssd_chunked_kernel, SEQS, (), {**shapes, "BP": block_p, "BN": 128}, warps), flush=True)


if __name__ == "__main__":
    main()
