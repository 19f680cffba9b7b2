"""The decode-attention kernel's SASS, counted on a CPU (no GPU needed): compile `_decode_kernel` for sm_90 with
the installed triton and its bundled ptxas (the integer arguments specialized as a launch with 16-divisible
strides specializes them), disassemble it with the bundled cuobjdump, and print the most frequent opcodes.

    python benchmarks/decode_attention_sass.py [--cache bf16|fp8] [--block-n 64] [--top 25]

Session 29 (benchmarks/RESULTS.md) read an FP8 cache's path off it: the tiles reach shared memory by 16-byte
asynchronous copies as a bf16 cache's do, but come out one byte per load (`LDS.U8`) into the dot operands, each
value widened by `F2FP.F16.E4M3.UNPACK_B` then `F2F.BF16.F16`, with more barriers.
"""

from __future__ import annotations

import argparse
import collections
import inspect
import re
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from llmc.kernels import attention_triton

sys.path.insert(0, str(Path(__file__).parent))
from w4a16_sass_count import disassemble, loop_opcodes  # noqa: E402

NOT_SPECIALIZED = {"window", "num_partitions", "partition_size", "stride_bt"}  # the kernel's do_not_specialize


def compile_sass(fp8: bool, block_n: int, num_warps: int = 4, num_stages: int = 3) -> str:
    """SASS of a Llama-3-8B-shaped decode-only step's kernel (4 query heads per KV head, head_dim 128, 16-token
    blocks, unsplit, the rotary embedding and KV write inside)."""
    kernel = attention_triton._decode_kernel
    params = list(inspect.signature(kernel.fn).parameters)
    constants = dict(GROUP=4, HEAD_DIM=128, BLOCK_G=16, BLOCK_D=128, BLOCK_N=block_n, BLOCK_SIZE=16,
                     IS_PARTITIONED=False, HAS_WINDOW=False, PRECISION="tf32", IS_DENSE=True, MERGE_IN_KERNEL=False,
                     ROTATE=True, FP8_MAX=448.0 if fp8 else 0.0, PDL=True)
    signature = {}
    for name in params:
        if name in constants:
            signature[name] = "constexpr"
        elif name in ("k_ptr", "v_ptr"):
            signature[name] = "*fp8e4nv" if fp8 else "*bf16"
        elif name in ("q_ptr", "out_ptr", "new_k_ptr", "new_v_ptr"):
            signature[name] = "*bf16"
        elif name in ("part_acc_ptr", "part_ml_ptr", "cos_sin_ptr"):
            signature[name] = "*fp32"
        elif name in ("pos_ptr", "slot_ptr"):
            signature[name] = "*i64"
        elif name.endswith("_ptr"):
            signature[name] = "*i32"
        elif name in ("scale_log2", "v_scale", "inv_k_scale", "inv_v_scale"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    attrs = {(params.index(name),): [["tt.divisibility", 16]] for name in params
             if signature[name] != "constexpr" and name not in NOT_SPECIALIZED and signature[name] != "fp32"}
    compiled = triton.compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages, "launch_pdl": True})
    return disassemble(compiled)


def opcodes(sass: str) -> list[str]:
    ops = []
    for line in sass.splitlines():
        match = re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if match:
            ops.append(match.group(1))
    return ops


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", choices=["bf16", "fp8"], default="fp8")
    parser.add_argument("--block-n", type=int, default=None, help="keys per tile (default: the kernel's for the cache)")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    fp8 = args.cache == "fp8"
    block_n = args.block_n or attention_triton.DECODE_BLOCK_N[fp8]
    sass = compile_sass(fp8, block_n, **attention_triton.DECODE_LAUNCH)
    loop = loop_opcodes(sass)
    print(f"{args.cache} cache, {block_n} keys per tile: {len(opcodes(sass))} SASS instructions, "
          f"{sum(loop.values())} in the first loop (the kernel's loop over key tiles)")
    for op, count in loop.most_common(args.top):
        print(f"{count:6d}  {op}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
