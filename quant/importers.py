"""Unpacking published checkpoint layouts into `QuantizedWeight` (no re-quantization), and the writers.

Every `unpack_*` has a `pack_*` inverse that writes the published layout, so tests build fixtures
the way the publishing tools do. Levels, zeros and scales follow `QuantizedWeight`:
w = (level - zero) * scale with levels in [0, 2**bits).

AutoAWQ GEMM (4 bits, asymmetric):
  qweight int32 [in, out/8]  packed along the OUTPUT dim: word j holds outputs 8j..8j+7, nibble k
                             (bits 4k..4k+3) = output 8j + AWQ_ORDER[k], AWQ_ORDER = 0,2,4,6,1,3,5,7
  qzeros  int32 [G, out/8]   zero levels, packed the same way, stored as is
  scales  fp16  [G, out]
GPTQ (AutoGPTQ / GPTQModel):
  qweight int32 [in*bits/32, out]  packed along the INPUT dim as a little-endian bit stream
                                   (= 32/bits levels per word for 2/4/8 bits; 32 levels in 3 words for 3)
  qzeros  int32 [G, out*bits/32]   packed along the output dim the same way; checkpoint_format v1
                                   ("gptq") stores zero - 1 (mod 2**bits), v2 ("gptq_v2") stores zero
  scales  fp16  [G, out]
  g_idx   int32 [in]               group of each input column (non-contiguous with desc_act)
compressed-tensors pack-quantized (int):
  weight_packed     int32 [out, ceil(in / (32//bits))]  packed along the input dim, 32//bits per word,
                                                        signed levels stored + 2**(bits-1) (= our levels)
  weight_scale      [out, G]
  weight_zero_point int32 [ceil(out / (32//bits)), G]   only if asymmetric: packed along the OUTPUT dim,
                                                        signed + 2**(bits-1) (older: int8 [out, G] signed)
  weight_shape      int [2] = (out, in);  weight_g_idx int32 [in] only with actorder "group"
compressed-tensors float-quantized (fp8): weight float8_e4m3fn [out, in], weight_scale [out, 1] or [1],
  input_scale [1] when activations are static.
compressed-tensors float-quantized FP8_BLOCK, and quant_method fp8 with weight_block_size (transformers, DeepSeek-V3,
  Qwen3): weight float8_e4m3fn [out, in], weight_scale (fp8: weight_scale_inv, the same dequantization factor)
  [ceil(out / rows), ceil(in / columns)], one per block from row 0 and column 0, the last ones partial:
  w[o, i] = weight[o, i] * scale[o // rows, i // columns].
quant_method fp8 without weight_block_size (vLLM's per-tensor FP8): weight, weight_scale [] or [1] (transformers:
  weight_scale_inv), input_scale (activation_scale) when activation_scheme is static.
NVIDIA ModelOpt FP8 (quant_method modelopt, hf_quant_config.json): the float-quantized tensors, weight, weight_scale []
  and input_scale [] (quant_algo FP8), or weight_scale [out] and no input_scale (FP8_PER_CHANNEL_PER_TOKEN).
compressed-tensors int-quantized (W8A8 int8): weight int8 [out, in] (signed levels -128..127), weight_scale
  [out, 1] (model dtype), weight_zero_point int8 [out, 1] of zeros in versions that save symmetric zero points;
  activations per token at run time (nothing stored).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import Tensor

from llmc.errors import CheckpointError
from llmc.kernels.fp8 import compact_row_scales
from llmc.quant.formats import QuantizedWeight, default_g_idx
from llmc.quant.import_config import ImportSpec, canonical_tensor_names, check_module_tensors
from llmc.quant.packing import (
    deinterleave_awq,
    interleave_awq,
    pack_bitstream,
    pack_words,
    unpack_bitstream,
    unpack_words,
)


def _trivial_to_none(g_idx: Tensor | None, in_features: int, group_size: int) -> Tensor | None:
    """Drop a g_idx that is just i // group_size: contiguous groups need none."""
    if g_idx is None or torch.equal(
        g_idx.to(torch.int32), default_g_idx(in_features, group_size, g_idx.device)
    ):
        return None
    return g_idx.to(torch.int32).contiguous()


def _implicit_to_none(zeros: Tensor, bits: int) -> Tensor | None:
    """Zeros that all equal 2**(bits-1) are the symmetric convention: drop them."""
    return None if bool((zeros == 2 ** (bits - 1)).all()) else zeros.to(torch.int32).contiguous()


def _zeros_or_implicit(q: QuantizedWeight) -> Tensor:
    return (
        q.zeros
        if q.zeros is not None
        else torch.full(q.scales.shape, 2 ** (q.bits - 1), dtype=torch.int32, device=q.scales.device)
    )


# --- AutoAWQ GEMM ---------------------------------------------------------------------------------


def unpack_awq_gemm(tensors: Mapping[str, Tensor], group_size: int) -> QuantizedWeight:
    num_out = tensors["scales"].shape[1]
    levels = deinterleave_awq(unpack_words(tensors["qweight"], 4, dim=1, size=num_out), dim=1)  # [in, out]
    zeros = deinterleave_awq(unpack_words(tensors["qzeros"], 4, dim=1, size=num_out), dim=1)  # [G, out]
    return QuantizedWeight(
        qweight=levels.T.contiguous(),
        scales=tensors["scales"].float().T.contiguous(),
        zeros=zeros.T.contiguous(),
        bits=4,
        group_size=group_size,
    )


def pack_awq_gemm(q: QuantizedWeight, scale_dtype: torch.dtype = torch.float16) -> dict[str, Tensor]:
    if q.bits != 4 or q.g_idx is not None or q.out_features % 8:
        raise ValueError("AutoAWQ GEMM holds 4-bit weights without g_idx and out_features divisible by 8")
    return {
        "qweight": pack_words(interleave_awq(q.qweight.T, dim=1), 4, dim=1),  # [in, out/8]
        "qzeros": pack_words(interleave_awq(_zeros_or_implicit(q).T, dim=1), 4, dim=1),  # [G, out/8]
        "scales": q.scales.T.to(scale_dtype).contiguous(),
    }  # [G, out]


# --- GPTQ (AutoGPTQ v1 / GPTQModel v2) -------------------------------------------------------------


def unpack_gptq(
    tensors: Mapping[str, Tensor], bits: int, group_size: int, is_v1: bool = True
) -> QuantizedWeight:
    qweight = tensors["qweight"]  # [in * bits / 32, out]
    num_out = qweight.shape[1]
    num_in = qweight.shape[0] * 32 // bits
    levels = unpack_bitstream(qweight, bits, dim=0, size=num_in)  # [in, out]
    stored_zeros = unpack_bitstream(tensors["qzeros"], bits, dim=1, size=num_out)  # [G, out]
    # v1 wrote zero - 1 wrapped to `bits` bits (a stored 2**bits - 1 is a zero of 0).
    zeros = (stored_zeros + 1) % 2**bits if is_v1 else stored_zeros
    return QuantizedWeight(
        qweight=levels.T.contiguous(),
        scales=tensors["scales"].float().T.contiguous(),
        zeros=_implicit_to_none(zeros.T, bits),
        bits=bits,
        group_size=group_size,
        g_idx=_trivial_to_none(tensors.get("g_idx"), num_in, group_size),
    )


def pack_gptq(
    q: QuantizedWeight, is_v1: bool = True, scale_dtype: torch.dtype = torch.float16
) -> dict[str, Tensor]:
    stored_zeros = (_zeros_or_implicit(q) - 1) % 2**q.bits if is_v1 else _zeros_or_implicit(q)  # [out, G]
    g_idx = q.column_groups()
    return {
        "qweight": pack_bitstream(q.qweight.T, q.bits, dim=0),  # [in * bits / 32, out]
        "qzeros": pack_bitstream(stored_zeros.T, q.bits, dim=1),  # [G, out * bits / 32]
        "scales": q.scales.T.to(scale_dtype).contiguous(),  # [G, out]
        "g_idx": g_idx.to(torch.int32).contiguous(),
    }


# --- compressed-tensors ----------------------------------------------------------------------------


def unpack_pack_quantized(tensors: Mapping[str, Tensor], bits: int, group_size: int) -> QuantizedWeight:
    num_out, num_in = (int(d) for d in tensors["weight_shape"].tolist())
    levels = unpack_words(tensors["weight_packed"], bits, dim=1, size=num_in)  # [out, in]
    scales = tensors["weight_scale"].float().reshape(num_out, -1)  # [out, G]
    zero_point = tensors.get("weight_zero_point")
    if zero_point is None:
        zeros = None
    elif zero_point.dtype == torch.int32 and zero_point.shape[0] != num_out:
        zeros = unpack_words(zero_point, bits, dim=0, size=num_out)  # packed along out: [out, G]
    else:  # unpacked signed zero points (older compressed-tensors)
        zeros = zero_point.to(torch.int32).reshape(num_out, -1) + 2 ** (bits - 1)
    return QuantizedWeight(
        qweight=levels,
        scales=scales.contiguous(),
        zeros=None if zeros is None else _implicit_to_none(zeros, bits),
        bits=bits,
        group_size=group_size,
        g_idx=_trivial_to_none(tensors.get("weight_g_idx"), num_in, group_size),
    )


def pack_pack_quantized(q: QuantizedWeight, scale_dtype: torch.dtype = torch.bfloat16) -> dict[str, Tensor]:
    tensors = {
        "weight_packed": pack_words(q.qweight, q.bits, dim=1),  # [out, ceil(in / (32//bits))]
        "weight_scale": q.scales.to(scale_dtype).contiguous(),  # [out, G]
        "weight_shape": torch.tensor([q.out_features, q.in_features], dtype=torch.int64),
    }
    if q.zeros is not None:
        tensors["weight_zero_point"] = pack_words(q.zeros, q.bits, dim=0)  # [ceil(out / (32//bits)), G]
    if q.g_idx is not None:
        tensors["weight_g_idx"] = q.g_idx.to(torch.int32).contiguous()
    return tensors


def unpack_float_quantized(tensors: Mapping[str, Tensor]) -> QuantizedWeight:
    weight = tensors["weight"]  # [out, in]
    if weight.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"float-quantized weight has dtype {weight.dtype}; llmc imports float8_e4m3fn")
    scale = tensors["weight_scale"].float()
    scale = (
        scale.reshape(1, 1) if scale.numel() == 1 else scale.reshape(weight.shape[0], 1)
    )  # [1, 1] | [out, 1]
    input_scale = tensors.get("input_scale")
    return QuantizedWeight(
        qweight=weight,
        scales=scale,
        zeros=None,
        bits=8,
        group_size=-1,
        input_scale=None if input_scale is None else input_scale.float().reshape(1),
    )


def pack_float_quantized(q: QuantizedWeight) -> dict[str, Tensor]:
    is_per_tensor = q.scales.numel() == 1
    tensors = {
        "weight": q.qweight.contiguous(),
        "weight_scale": q.scales.reshape(1) if is_per_tensor else q.scales.reshape(-1, 1).contiguous(),
    }
    if q.input_scale is not None:
        tensors["input_scale"] = q.input_scale.float().reshape(1)
    return tensors


def unpack_fp8_block(weight: Tensor, scale: Tensor, block_size: tuple[int, int]) -> QuantizedWeight:
    """weight fp8 [out, in] and its block scales [ceil(out / rows), ceil(in / columns)] → the plain form, scales per
    row ([out, ceil(in / columns)], the rows of a block repeating its scale: w8a8-fp8-block's storage)."""
    if weight.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"block fp8 weight has dtype {weight.dtype}; llmc imports float8_e4m3fn")
    if not bool(torch.isfinite(scale).all()):
        raise CheckpointError("block fp8 weight scales hold inf or NaN: the checkpoint is damaged")
    rows, columns = block_size
    scales = scale.float().repeat_interleave(rows, dim=0)[: weight.shape[0]].contiguous()
    return QuantizedWeight(qweight=weight, scales=scales, zeros=None, bits=8, group_size=columns)


def pack_fp8_block(q: QuantizedWeight, block_size: tuple[int, int]) -> dict[str, Tensor]:
    """The inverse of unpack_fp8_block in compressed-tensors' names: weight, weight_scale [ceil(out / rows), G]."""
    scales = compact_row_scales(q.scales, block_size[0])
    if scales is None or q.group_size != block_size[1]:
        raise ValueError(f"the weight's scales are not one per {list(block_size)} block")
    return {"weight": q.qweight.contiguous(), "weight_scale": scales}


def unpack_int_quantized(tensors: Mapping[str, Tensor]) -> QuantizedWeight:
    weight = tensors["weight"]  # [out, in] int8
    return QuantizedWeight(qweight=weight.to(torch.int32) + 128, scales=tensors["weight_scale"].float().reshape(-1, 1),
                           zeros=None, bits=8, group_size=-1)


def pack_int_quantized(q: QuantizedWeight, scale_dtype: torch.dtype = torch.bfloat16) -> dict[str, Tensor]:
    """weight int8 [out, in] and weight_scale [out, 1] in scale_dtype (float32 where that dtype would round it)."""
    scales = q.scales.float().reshape(-1, 1)
    if not torch.equal(scales.to(scale_dtype).float(), scales):
        scale_dtype = torch.float32
    return {"weight": (q.qweight - 128).to(torch.int8).contiguous(), "weight_scale": scales.to(scale_dtype).contiguous()}


# --- dispatch and fusion ---------------------------------------------------------------------------


def unpack_module(
    spec: ImportSpec, module_name: str, tensors: Mapping[str, Tensor], in_features: int, out_features: int
) -> QuantizedWeight:
    """Check one module's checkpoint tensors (names after the module prefix) and unpack them."""
    tensors = canonical_tensor_names(spec, tensors)
    check_module_tensors(spec, module_name, tensors, in_features, out_features)
    if spec.block_size:
        q = unpack_fp8_block(tensors["weight"], tensors[spec.scale_name], spec.block_size)
    elif spec.layout == "awq-gemm":
        q = unpack_awq_gemm(tensors, spec.group_size)
    elif spec.layout in ("gptq-v1", "gptq-v2"):
        q = unpack_gptq(tensors, spec.bits, spec.group_size, is_v1=spec.layout == "gptq-v1")
    elif spec.layout == "pack-quantized":
        q = unpack_pack_quantized(tensors, spec.bits, spec.group_size)
    elif spec.layout == "int-quantized":
        q = unpack_int_quantized(tensors)
    else:
        q = unpack_float_quantized(tensors)
    if spec.is_symmetric and not q.is_symmetric:
        raise CheckpointError(f"{module_name} has zero points but quantization_config says symmetric")
    if q.g_idx is not None and not spec.is_act_order:
        raise CheckpointError(f"{module_name} has act-order groups (a g_idx that is not column // group_size), but "
                              "quantization_config says no act-order (GPTQ desc_act: false, compressed-tensors actorder "
                              "not group): the config does not describe the tensors")
    return q


def _check_fusable(ws: Sequence[QuantizedWeight], names: Sequence[str]) -> None:
    first = ws[0]
    what = ", ".join(names) if names else f"{len(ws)} weights"
    for w in ws[1:]:
        if (w.bits, w.group_size, w.qweight.dtype) != (first.bits, first.group_size, first.qweight.dtype):
            raise CheckpointError(
                f"cannot fuse {what}: bits/group_size/dtype differ "
                f"({w.bits}/{w.group_size} vs {first.bits}/{first.group_size}); quantize them alike"
            )
        g_idx, first_g_idx = w.column_groups(), first.column_groups()
        if w.in_features != first.in_features or not torch.equal(g_idx.cpu(), first_g_idx.cpu()):
            raise CheckpointError(
                f"cannot fuse {what}: their input columns or act-order groups (g_idx) differ"
            )


def concat_out(ws: Sequence[QuantizedWeight], names: Sequence[str] = ()) -> QuantizedWeight:
    """Fuse weights that share an input (q/k/v, gate/up) along the output dim.

    Mixed symmetric/asymmetric inputs get explicit zeros; FP8 per-tensor scales become per channel
    (lossless) unless all are equal; static input scales fuse to their max (the widest range); block FP8 rows
    keep their own scales (stored per row), so members need not end on a block edge.
    """
    _check_fusable(ws, names)
    first = ws[0]
    if first.qweight.dtype == torch.float8_e4m3fn and first.group_size != -1:  # blocks: scales per row already
        return QuantizedWeight(torch.cat([w.qweight for w in ws]), torch.cat([w.scales for w in ws]), None, 8,
                               first.group_size)
    if first.qweight.dtype == torch.float8_e4m3fn:
        is_same_scale = all(w.scales.shape == (1, 1) and torch.equal(w.scales, first.scales) for w in ws)
        scales = (
            first.scales if is_same_scale else torch.cat([w.scales.expand(w.out_features, 1) for w in ws])
        )
        input_scales = [w.input_scale for w in ws if w.input_scale is not None]
        input_scale = torch.stack(input_scales).amax(dim=0) if input_scales else None
        return QuantizedWeight(
            torch.cat([w.qweight for w in ws]), scales, None, 8, -1, input_scale=input_scale
        )
    zeros = None if all(w.is_symmetric for w in ws) else torch.cat([_zeros_or_implicit(w) for w in ws])
    return QuantizedWeight(
        qweight=torch.cat([w.qweight for w in ws]),
        scales=torch.cat([w.scales for w in ws]),
        zeros=zeros,
        bits=first.bits,
        group_size=first.group_size,
        g_idx=first.g_idx,
    )
