"""The oracle: plain-torch dequantization and linear layers for every format (DESIGN §3).

Kernel tests and quality tests compare against these. They are written apart from the formats'
`apply` paths on purpose (a slot-by-slot unpack, groups by repeat instead of gather, FP8 scales
applied after the matmul as tensor cores do), so that a bug in one is not mirrored in the other.
Everything computes in float32.
"""

from __future__ import annotations

import torch
from torch import Tensor

from llmc.kernels.fp8 import expand_group_scales
from llmc.quant.formats import (DenseFormat, Fp8BlockFormat, Fp8Format, Int8W8A8Format, IntWeightFormat, LinearFormat,
                                QuantizedWeight)


def dequantize_weight(q: QuantizedWeight) -> Tensor:
    """The plain form's weight [out, in] float32 (the definition in QuantizedWeight's docstring)."""
    if q.qweight.dtype == torch.float8_e4m3fn and q.group_size != -1:  # blocks: scales [out, groups]
        return q.qweight.float() * expand_group_scales(q.scales.float(), q.group_size, q.in_features)
    if q.qweight.dtype == torch.float8_e4m3fn:
        return q.qweight.float() * q.scales.float()  # scales [out, 1] or [1, 1] broadcast
    if q.g_idx is not None:
        g_idx = q.g_idx.long()
    elif q.group_size == -1:
        g_idx = torch.zeros(q.in_features, dtype=torch.long, device=q.qweight.device)
    else:
        g_idx = torch.arange(q.in_features, device=q.qweight.device) // q.group_size
    zeros = q.zeros.float() if q.zeros is not None else torch.full_like(q.scales.float(), 2 ** (q.bits - 1))
    return (q.qweight.float() - zeros[:, g_idx]) * q.scales.float()[:, g_idx]


def _unpack_slots(words: Tensor, bits: int, size: int) -> Tensor:
    """[rows, num_words] int32 words → [rows, size] levels; slot k holds bits [bits*k, bits*(k+1))."""
    unsigned = words.long() % 2**32
    slots = [(unsigned >> (bits * k)) % 2**bits for k in range(32 // bits)]  # each [rows, num_words]
    return torch.stack(slots, dim=2).reshape(words.shape[0], -1)[:, :size]


def _infer_in_features(fmt: IntWeightFormat, params: dict[str, Tensor]) -> int:
    if fmt.has_g_idx:
        return params["g_idx"].numel()
    if fmt.group_size > 0:
        return params["scales"].shape[1] * fmt.group_size
    raise ValueError("per-channel integer weights are zero-padded to whole words: pass in_features")


def _dequantize_int(fmt: IntWeightFormat, params: dict[str, Tensor], in_features: int) -> Tensor:
    levels = _unpack_slots(params["qweight"], fmt.bits, in_features).double()  # [out, in]
    scales = params["scales"].double()  # [out, G]
    if fmt.symmetric:
        zeros = torch.full_like(scales, 2.0 ** (fmt.bits - 1))
    else:
        zeros = _unpack_slots(params["qzeros"], fmt.bits, scales.shape[1]).double()  # [out, G]
    if fmt.has_g_idx:
        per_column = params["g_idx"].long()  # [in]
        return ((levels - zeros[:, per_column]) * scales[:, per_column]).float()
    group_size = in_features if fmt.group_size == -1 else fmt.group_size
    zeros = zeros.repeat_interleave(group_size, dim=1)  # [out, in]
    scales = scales.repeat_interleave(group_size, dim=1)
    return ((levels - zeros) * scales).float()


def dequantize(fmt: LinearFormat, params: dict[str, Tensor], in_features: int | None = None) -> Tensor:
    """The weight [out, in] float32 that `params` (as `fmt.pack` wrote them) stand for.

    `in_features` is needed only where padding hides it (per-channel integer formats).
    """
    if isinstance(fmt, DenseFormat):
        return params["weight"].float()
    if isinstance(fmt, (Fp8Format, Fp8BlockFormat, Int8W8A8Format)):
        return fmt.dequantize(params)
    if isinstance(fmt, IntWeightFormat):
        return _dequantize_int(fmt, params, in_features or _infer_in_features(fmt, params))
    raise TypeError(f"no reference for format {fmt.name!r}")


def int8_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """Dynamic per-token int8 of x [..., in] (vLLM's): (levels [..., in] float64, scale [..., 1] float64), scale =
    absmax / 127 computed in float32, levels = x / scale rounded half to even and clamped to ±127."""
    absmax = x.float().abs().amax(dim=-1, keepdim=True)
    scale = torch.clamp(absmax / 127.0, min=torch.finfo(torch.float32).tiny * 2**10)  # float32, as the GPU's
    levels = torch.clamp(torch.round(x.float() / scale), -127, 127)
    return levels.double(), scale.double()


def reference_linear(fmt: LinearFormat, x: Tensor, params: dict[str, Tensor], bias: Tensor | None) -> Tensor:
    """y = x @ w.T + bias in float32, returned in x's dtype; FP8 also quantizes the activations."""
    if isinstance(fmt, Fp8Format):
        x_fp8, x_scale = fmt.quantize_input(x, params)  # [..., in], [..., 1] or [1]
        accumulated = x_fp8.float() @ params["weight"].float().T  # [..., out]: what tensor cores sum
        y = accumulated * x_scale * params["weight_scale"].float().reshape(1, -1)
    elif isinstance(fmt, Fp8BlockFormat):  # each group's scales applied to its columns, summed in float64
        x_fp8, x_scale = fmt.quantize_input(x, params)  # [..., in], [..., groups]
        columns = x_fp8.shape[-1]
        x_values = x_fp8.double() * expand_group_scales(x_scale.double(), fmt.group_size, columns)
        w_values = params["weight"].double() * expand_group_scales(params["weight_scale"].double(), fmt.group_size, columns)
        y = (x_values @ w_values.T).float()
    elif isinstance(fmt, Int8W8A8Format):
        x_int8, x_scale = int8_per_token(x)  # [..., in] float64 integers, [..., 1]
        accumulated = x_int8 @ params["weight"].double().T  # [..., out]: exact in float64
        y = (accumulated * x_scale * params["weight_scale"].double().reshape(1, -1)).float()
    else:
        y = x.float() @ dequantize(fmt, params, x.shape[-1]).T  # [..., out]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
