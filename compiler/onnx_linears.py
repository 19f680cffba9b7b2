"""Linear layers of the ONNX graph, from the artifact's packed tensors, with no second rounding.

A w4a16 (or w8a16) linear becomes com.microsoft MatMulNBits holding the quantizer's own levels,
scales and zero points, repacked into its layout:

  B            uint8 [N, K / block, block * bits / 8]  level of input column k of block j at byte
                                                        (k % block) * bits / 8, low bits first
  scales       float32 [N, K / block]                   the artifact's scales, cast exactly to float32
  zero_points  uint8 [N, ceil(K / block * bits / 8)]    only with zero points, packed like B; symmetric
                                                        weights use the op's default 2**(bits-1), ours

block = the group size. Per-channel weights (group_size -1) use the largest power-of-two block
(16..128) that divides K, every block of a row repeating the row's scale and zero: the same weight.
What MatMulNBits cannot hold becomes a float32 MatMul of the exact dequantized weight, said once in
the build log and recorded per linear: 3-bit levels (the CPU kernel takes 2, 4 and 8 bits),
act-order g_idx, K not a multiple of 16, and FP8 (the CPU EP has no FP8 matmul: FP8 values times
their scales, activations unquantized). An act-order down projection, whose groups the build put in
order (compiler/shard.order_down_groups), is a MatMulNBits like a plain linear (`in_order_as_plain`).

A w8a8-int8 linear (method int8) is kernels/int8.int8_linear in standard ops, the same float32 ops in the
same order, so the torch runtime's numbers exactly (tests/runtime/test_onnx_int8.py):

  amax = ReduceMax(Abs(x), -1); s = Max(amax / 127, MIN_SCALE)               per token, [.., 1]
  xu = Cast<uint8>(Clip(Round(x / s), -127, 127) + 128)                      Round: half to even
  y = Cast<float>(MatMulInteger(xu, W_t, a_zero_point 128)) * s * w_scale (+ bias)

with W_t the artifact's int8 levels transposed, [K, N], and w_scale [1, N]. The activations go in as uint8
with zero point 128 (the same integers) because onnxruntime 1.32's CPU EP runs uint8 x int8 through MLAS's
fast int8 GEMM and int8 x int8 about 40x slower (measured: a 384x2048 linear, 1 token: u8s8 10 us, s8s8
420 us, float32 MatMul 21 us). The int32 sums are exact where that GEMM accumulates products in int32
(VNNI: AVX512-VNNI, AVX-VNNI; ARM64's dot-product instructions); MLAS's plain-AVX2 u8s8 kernel adds pairs
of products in saturating int16 (vpmaddubsw), which two products of |xq| near 127 and |w| near 128 can
overflow: not measured here (this machine has VNNI).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import Tensor

from llmc.quant.formats import DenseFormat, IntWeightFormat, default_g_idx, make_format
from llmc.quant.packing import unpack_words
from llmc.quant.reference import dequantize

logger = logging.getLogger("llmc")

MATMUL_NBITS_BITS = (4, 8)  # what llmc emits as MatMulNBits (the op takes 2, 4, 8)
MAX_BLOCK = 128
INT8_ZERO_POINT = 128  # w8a8-int8 activations enter MatMulInteger as uint8 levels + 128 (see above)
INT8_LINEAR = "MatMulInteger(w8a8-int8: per-token activations uint8 - 128, int8 weights)"


def in_order_as_plain(spec: dict, params: dict[str, Tensor], in_features: int) -> tuple[dict, dict[str, Tensor]]:
    """(spec, params) of an act-order linear whose groups are in plain order (down, which the build puts in
    order: compiler/shard.order_down_groups) as those of the same linear without g_idx, which MatMulNBits
    holds; any other linear's unchanged."""
    g_idx = params.get("g_idx")
    if not spec.get("has_g_idx") or g_idx is None or not torch.equal(
            g_idx.to(torch.int32), default_g_idx(in_features, spec["group_size"], g_idx.device)):
        return spec, params
    return {**spec, "has_g_idx": False}, {name: t for name, t in params.items() if name != "g_idx"}


def nbits_block_size(fmt: IntWeightFormat, in_features: int) -> int | None:
    """MatMulNBits' block_size for this format and K, or None when the weight cannot be one."""
    if fmt.bits not in MATMUL_NBITS_BITS or fmt.has_g_idx or fmt.is_gpu_layout:
        return None
    if fmt.group_size != -1:
        return fmt.group_size
    block = MAX_BLOCK
    while block >= 16 and in_features % block:
        block //= 2
    return block if block >= 16 else None


def pack_nbits(levels: np.ndarray, bits: int, block: int) -> np.ndarray:
    """levels [N, K] (values < 2**bits) → uint8 [N, K / block, block * bits / 8], low bits first."""
    n, k = levels.shape
    per_byte = 8 // bits
    grouped = levels.astype(np.uint8).reshape(n, k // per_byte, per_byte)
    packed = np.zeros((n, k // per_byte), dtype=np.uint8)
    for slot in range(per_byte):
        packed |= grouped[:, :, slot] << (bits * slot)
    return packed.reshape(n, k // block, block * bits // 8)


def pack_zero_points(zeros: np.ndarray, bits: int) -> np.ndarray:
    """zero levels [N, num_blocks] → uint8 [N, ceil(num_blocks * bits / 8)], packed like B."""
    n, num_blocks = zeros.shape
    per_byte = 8 // bits
    padded = np.zeros((n, -(-num_blocks // per_byte) * per_byte), dtype=np.uint8)
    padded[:, :num_blocks] = zeros
    return pack_nbits(padded, bits, padded.shape[1])[:, 0, :]


def unpack_nbits(packed: np.ndarray, bits: int, in_features: int) -> np.ndarray:
    """The inverse of pack_nbits: uint8 [N, blocks, blob] → levels [N, K] int32 (for tests and inspect)."""
    flat = packed.reshape(packed.shape[0], -1)
    slots = [(flat >> (bits * s)) & (2**bits - 1) for s in range(8 // bits)]
    return np.stack(slots, axis=2).reshape(packed.shape[0], -1)[:, :in_features].astype(np.int32)


def nbits_tensors(fmt: IntWeightFormat, params: dict[str, Tensor], in_features: int, block: int) -> dict[str, np.ndarray]:
    """{"B", "scales", optional "zero_points"} of one MatMulNBits from the artifact's plain-layout tensors."""
    levels = unpack_words(params["qweight"], fmt.bits, dim=1, size=in_features).numpy()  # [N, K]
    scales = params["scales"].float().numpy()  # [N, G]
    repeat = (in_features // block) // scales.shape[1]  # > 1 only per channel
    tensors = {"B": pack_nbits(levels, fmt.bits, block), "scales": np.repeat(scales, repeat, axis=1)}
    if not fmt.symmetric:
        zeros = unpack_words(params["qzeros"], fmt.bits, dim=1, size=scales.shape[1]).numpy()
        tensors["zero_points"] = pack_zero_points(np.repeat(zeros, repeat, axis=1), fmt.bits)
    return tensors


def int8_tensors(params: dict[str, Tensor]) -> dict[str, np.ndarray]:
    """{"weight_t": int8 [K, N], "w_scale": float32 [1, N]} of one w8a8-int8 linear: the artifact's levels and
    scales, unchanged."""
    return {"weight_t": np.ascontiguousarray(params["weight"].numpy().T),
            "w_scale": params["weight_scale"].float().numpy().reshape(1, -1)}


def float_weight(spec: dict, params: dict[str, Tensor], in_features: int) -> np.ndarray:
    """The linear's weight [N, K] float32, exactly as the torch runtime computes with it."""
    fmt = make_format(spec, torch.float32)
    if isinstance(fmt, DenseFormat):
        return params["weight"].float().numpy()
    return dequantize(fmt, params, in_features).numpy()


def fallback_reason(spec: dict, in_features: int) -> str | None:
    """Why a quantized linear runs as float32 MatMul on this target (None: dense, or MatMulNBits)."""
    if spec["format"] == "dense":
        return None
    if spec["format"] == "w8a8-int8":
        return None  # MatMulInteger (int8_tensors)
    if spec["format"] in ("w8a8-fp8", "w8a8-fp8-block"):
        return "fp8: no FP8 matmul on the CPU EP; float32 weights = FP8 values x scales, activations unquantized"
    fmt = make_format(spec, torch.float32)
    if nbits_block_size(fmt, in_features) is not None:
        return None
    if fmt.bits not in MATMUL_NBITS_BITS:
        return f"{fmt.bits}-bit levels (MatMulNBits on CPU takes 4 and 8 bits here): float32 dequantized weights"
    if fmt.has_g_idx:
        return "act-order g_idx: float32 dequantized weights"
    return f"in_features {in_features} is not a multiple of 16: float32 dequantized weights"


def log_fallbacks(reasons: dict[str, str]) -> None:
    """One build-log line per reason, naming how many linears it covers."""
    by_reason: dict[str, list[str]] = {}
    for module, reason in reasons.items():
        by_reason.setdefault(reason, []).append(module)
    for reason, modules in by_reason.items():
        logger.warning("onnx-cpu: %d linear(s) (e.g. %s) run as float MatMul: %s", len(modules), modules[0], reason)
