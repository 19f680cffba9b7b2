"""The few-token Gluon W4A16 kernel's SASS, counted on a CPU (no GPU needed): compile the `wgmma` kind
for sm_90 with the installed triton and its bundled ptxas, disassemble it with the bundled cuobjdump,
and count the opcodes of the loop over K tiles (the first backward branch's body).

    python benchmarks/w4a16_sass_count.py [--block-m 16] [--block-n 128] [--warps 4] [--no-scale-acc]

Session 19's table in benchmarks/RESULTS.md (gate_up's one-token entry: 16 x 128, 4 warps, scale_acc,
symmetric, no split) came from this: 386 instructions with triton 3.9, 383 with 3.6.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

from llmc.kernels import w4a16_gluon


def compile_sass(block_m: int, block_n: int, warps: int, scale_acc: bool, zeros: bool = False,
                 scale_ring: bool = False, zero_ring: bool = True, live_operands: bool = True) -> str:
    x_layout = gl.NVMMASharedLayout.get_default_for([block_m, w4a16_gluon.X_BOX_K], gl.bfloat16)
    w_layout = gl.NVMMASharedLayout.get_default_for([16, block_n], gl.int32)
    constants = {"GROUP_SIZE": 128, "HAS_ZEROS": zeros, "HAS_BIAS": False, "IS_SPLIT": False, "SUM_SPLITS": 0,
                 "STAGES": 4, "PER_TILE": True, "SCALE_ACC": scale_acc, "PDL": True, "num_warps": warps,
                 "SILU_MUL": False, "SILU_MUL_LATE_DEPENDENTS": True, "SCALE_RING": scale_ring,
                 "ZERO_RING": scale_ring and zeros and zero_ring,
                 "LIVE_OPERANDS": live_operands and w4a16_gluon.live_operands(True, scale_acc, warps)}
    s_layout = gl.NVMMASharedLayout.get_default_for([block_n], gl.bfloat16)
    z_layout = gl.NVMMASharedLayout.get_default_for([block_n // 8], gl.int32)
    signature = {
        "x_desc": f"tensordesc<bf16[{block_m}, {w4a16_gluon.X_BOX_K}],{x_layout!r}>",
        "w_desc": f"tensordesc<i32[16, {block_n}],{w_layout!r}>",
        "s_ptr": "*bf16", "qz_ptr": "*i32", "bias_ptr": "*bf16", "out_ptr": "*bf16", "final_ptr": "*bf16",
        "counter_ptr": "*i32", "s_desc": f"tensordesc<bf16[{block_n}],{s_layout!r}>" if scale_ring else "*bf16",
        "z_desc": f"tensordesc<i32[{block_n // 8}],{z_layout!r}>" if constants["ZERO_RING"] else "*i32",
        **{name: "i32" for name in ("M", "N", "num_groups", "num_tiles", "tiles_per_split", "stride_om",
                                    "stride_split")},
        **{name: "constexpr" for name in constants},
    }
    kernel = triton.compile(GluonASTSource(w4a16_gluon._w4a16_wgmma_kernel, signature, constants),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "launch_pdl": True})
    return disassemble(kernel)


def disassemble(kernel) -> str:
    """The SASS of a kernel compiled for sm_90 (triton.compile), by triton's bundled ptxas and cuobjdump."""
    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as tmp:
        ptx, obj = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.o")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        subprocess.run([ptxas, "-arch=sm_90a", ptx, "-o", obj], check=True)
        cuobjdump = os.path.join(os.path.dirname(ptxas), "cuobjdump")
        return subprocess.run([cuobjdump, "-sass", obj], capture_output=True, text=True, check=True).stdout


def loop_opcodes(sass: str) -> collections.Counter:
    """Opcodes (prmt with its selector) between the first backward branch and its target."""
    instructions = [(int(m.group(1), 16), m.group(2).strip())
                    for m in (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    for address, text in instructions:
        target = re.search(r"BRA\s+(?:`\()?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            start, end = int(target.group(1), 16), address
            break
    else:
        raise SystemExit("no loop found in the SASS")
    counts = collections.Counter()
    for address, text in instructions:
        if start <= address <= end:
            opcode = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]
            counts[opcode + (" " + text.split(",")[2].strip() if opcode == "PRMT" else "")] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-m", type=int, default=16)
    parser.add_argument("--block-n", type=int, default=128)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--no-scale-acc", action="store_true")
    parser.add_argument("--zeros", action="store_true", help="asymmetric (qzeros)")
    parser.add_argument("--scale-ring", action="store_true", help="the group scales by TMA with the words")
    parser.add_argument("--no-zero-ring", action="store_true", help="with --scale-ring: zero points by global loads")
    parser.add_argument("--no-live-operands", action="store_true",
                        help="w4a16_gluon.LIVE_OPERANDS off (else as the launcher sets it: --no-scale-acc on 4 warps)")
    args = parser.parse_args()
    counts = loop_opcodes(compile_sass(args.block_m, args.block_n, args.warps, not args.no_scale_acc, args.zeros,
                                       args.scale_ring, not args.no_zero_ring,
                                       not args.no_live_operands))
    print(f"triton {triton.__version__}: {sum(counts.values())} instructions in the loop over K tiles")
    for opcode, count in counts.most_common():
        print(f"{count:5d}  {opcode}")


if __name__ == "__main__":
    main()
