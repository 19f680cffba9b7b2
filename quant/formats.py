"""What a quantized weight IS: one `LinearFormat` per format, keyed by name (DESIGN §3).

Algorithms (RTN, GPTQ, AWQ, FP8 scaling, importers) produce a `QuantizedWeight`; a format packs it
into the artifact's tensors at compile time (`pack`) and runs a linear layer on them at run time
(`apply`). The runtime dispatches on the format and never learns which algorithm made a weight.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from llmc.errors import RecipeError
from llmc.kernels import can_use_triton
from llmc.kernels.activation import GATE_UP_INTERLEAVE, silu_and_mul
from llmc.kernels.w4a16_gemm import (dequantize_w4a16, gpu_packed_shapes, interleave_gate_up, pack_w4a16_for_gpu,
                                    w4a16_linear, w4a16_silu_mul)
from llmc.kernels import fp8 as fp8_kernels
from llmc.kernels.int8 import int8_linear
from llmc.quant.numerics import FP8_DTYPE, quantize_fp8_static
from llmc.quant.packing import num_words, pack_words, unpack_words

logger = logging.getLogger("llmc")


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one artifact tensor of a linear layer."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class QuantizedWeight:
    """A quantized weight in plain, unpacked form: the meeting point of algorithms, importers and formats.

    Integer formats: w[o, i] = (qweight[o, i] - zeros[o, g_idx[i]]) * scales[o, g_idx[i]].
    FP8: w[o, i] = qweight[o, i].float() * scales[o, 0]  (per-channel) or * scales[0, 0] (per-tensor);
    FP8 in blocks: * scales[o, i // group_size].
    """

    qweight: Tensor  # [out_features, in_features] int32 levels in [0, 2**bits) (int) | float8_e4m3fn (fp8)
    scales: Tensor  # [out_features, num_groups] float32 (int) | [out_features, 1] or [1, 1] float32 (fp8)
    zeros: Tensor | None  # [out_features, num_groups] int32 levels; None = symmetric (zero = 2**(bits-1))
    bits: int
    group_size: int  # -1 = one group spanning the whole input dimension (per output channel)
    g_idx: Tensor | None = (
        None  # [in_features] int32 group of each input column (act-order); None = i // group_size
    )
    input_scale: Tensor | None = None  # [1] float32 static per-tensor activation scale (fp8 static)

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def is_symmetric(self) -> bool:
        return self.zeros is None

    def column_groups(self) -> Tensor:
        """[in_features]: the group of each input column, g_idx (as stored) or i // group_size (int32)."""
        if self.g_idx is not None:
            return self.g_idx
        return default_g_idx(self.in_features, self.group_size, self.qweight.device)


class LinearFormat(Protocol):
    """One weight format. `spec()` is what the manifest records; `make_format(spec)` rebuilds it
    through the class's `from_spec(params, dtype)`."""

    name: str

    def spec(self) -> dict: ...

    def param_specs(self, in_features: int, out_features: int) -> dict[str, TensorSpec]: ...

    def pack(self, q: QuantizedWeight) -> dict[str, Tensor]: ...

    def apply(self, x: Tensor, params: dict[str, Tensor], bias: Tensor | None) -> Tensor: ...


@dataclass(frozen=True)
class DenseFormat:
    """Unquantized weights in the model dtype: the format of every linear a recipe does not quantize."""

    dtype: torch.dtype
    name: str = "dense"

    @classmethod
    def from_spec(cls, params: dict, dtype: torch.dtype) -> "DenseFormat":
        return cls(dtype)

    def spec(self) -> dict:
        return {"format": self.name}

    def param_specs(self, in_features: int, out_features: int) -> dict[str, TensorSpec]:
        return {"weight": TensorSpec((out_features, in_features), self.dtype)}

    def pack(self, q: QuantizedWeight) -> dict[str, Tensor]:
        raise TypeError("the dense format holds unquantized weights; use pack_dense")

    def pack_dense(self, weight: Tensor) -> dict[str, Tensor]:
        return {"weight": weight.to(self.dtype).contiguous()}

    def apply(self, x: Tensor, params: dict[str, Tensor], bias: Tensor | None) -> Tensor:
        return torch.nn.functional.linear(x, params["weight"], bias)


INT_FORMAT_NAMES = {3: "w3a16", 4: "w4a16", 8: "w8a16"}
SUPPORTED_GROUP_SIZES = (32, 64, 128, -1)


def default_g_idx(in_features: int, group_size: int, device: torch.device | None = None) -> Tensor:
    """[in_features] int32: contiguous groups, i // group_size (all 0 per channel)."""
    columns = torch.arange(in_features, dtype=torch.int32, device=device)
    return torch.zeros_like(columns) if group_size == -1 else columns // group_size


def num_groups_of(in_features: int, group_size: int) -> int:
    """Groups along the input dim; a group size that does not divide in_features is a recipe error."""
    if group_size == -1:
        return 1
    if group_size <= 0 or in_features % group_size:
        raise RecipeError(
            f"group_size {group_size} does not divide in_features {in_features}; "
            f"choose a group size that divides it, or -1 (per output channel)"
        )
    return in_features // group_size


@dataclass(frozen=True)
class IntWeightFormat:
    """Integer weight-only formats `w3a16`, `w4a16`, `w8a16`: int weights, activations in the model dtype.

    w[o, i] = (level[o, i] - zero[o, g]) * scale[o, g], g = g_idx[i] if has_g_idx else i // group_size
    (g = 0 when group_size is -1, one group per output channel). Symmetric: zero = 2**(bits-1), implicit
    (= compressed-tensors' signed levels shifted by 2**(bits-1)).

    Tensors, with L = 32 // bits levels per int32 word (8 for 4 bits, 4 for 8 bits, 10 for 3 bits) and
    G = in // group_size groups (1 per channel):
      qweight  int32 [out, ceil(in / L)]  level of input column i in word i // L at bit offset
                                          bits * (i % L); last word zero-padded; 3-bit words leave
                                          bits 30..31 zero
      scales   dtype [out, G]             the model dtype
      qzeros   int32 [out, ceil(G / L)]   only if not symmetric: zero levels, packed like qweight
      g_idx    int32 [in]                 only if has_g_idx: group of each input column (act-order
                                          groups that are not contiguous)

    layout "gpu" (4 bits): the tensors of kernels/w4a16_gemm.py's pack_w4a16_for_gpu, the
    layout the Triton W4A16 GEMM reads (qweight [ceil(in/128)*16, out] int32, scales [G, out],
    qzeros [G, ceil(out/8)] int32); on CPU it dequantizes like the plain layout. With act-order
    groups (has_g_idx) the input columns are permuted once, at build time, so that each group is
    contiguous (as Marlin does): those tensors hold the permuted weight, and
      perm     int32 [in]                 input column perm[j] is the packed weight's column j;
                                          the kernels read x[..., perm]
    This needs every group to hold group_size columns, as GPTQ's act order makes them.

    kernel_table: the W4A16 kernel per (K, N, M) the artifact's plan records (w4a16_gemm's
    `parse_w4a16_table` form), handed in by the runtime's loader; None: the kernels' default table.
    Not part of the spec: it is the plan's, not the weights'.
    """

    dtype: torch.dtype
    bits: int = 4
    group_size: int = 128
    symmetric: bool = True
    has_g_idx: bool = False
    layout: str = "plain"  # "plain" | "gpu"
    kernel_table: Mapping | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.bits not in INT_FORMAT_NAMES:
            raise RecipeError(f"integer weights of {self.bits} bits are not supported; use bits 3, 4 or 8")
        if self.group_size not in SUPPORTED_GROUP_SIZES:
            raise RecipeError(
                f"group_size {self.group_size} is not supported; use one of {SUPPORTED_GROUP_SIZES}"
            )
        if self.layout not in ("plain", "gpu"):
            raise RecipeError(f"layout {self.layout!r} is not supported; use plain or gpu")
        if self.is_gpu_layout and self.bits != 4:
            raise RecipeError("layout gpu holds 4-bit weights; use layout plain")

    @property
    def is_gpu_layout(self) -> bool:
        return self.layout == "gpu"

    @property
    def name(self) -> str:
        return INT_FORMAT_NAMES[self.bits]

    @classmethod
    def from_spec(cls, params: dict, dtype: torch.dtype) -> "IntWeightFormat":
        known = {"bits", "group_size", "symmetric", "has_g_idx", "layout"}
        if unknown := sorted(set(params) - known):
            raise RecipeError(f"unknown integer-format field(s) {unknown}; known: {sorted(known)}")
        return cls(dtype, **params)

    def spec(self) -> dict:
        spec = {
            "format": self.name,
            "bits": self.bits,
            "group_size": self.group_size,
            "symmetric": self.symmetric,
            "has_g_idx": self.has_g_idx,
        }
        return spec if self.layout == "plain" else {**spec, "layout": self.layout}

    def param_specs(self, in_features: int, out_features: int) -> dict[str, TensorSpec]:
        num_groups = num_groups_of(in_features, self.group_size)
        if self.is_gpu_layout:
            shapes = gpu_packed_shapes(in_features, out_features, num_groups, self.symmetric)
            shapes |= {"perm": (in_features,)} if self.has_g_idx else {}
            return {
                name: TensorSpec(shape, self.dtype if name == "scales" else torch.int32)
                for name, shape in shapes.items()
            }
        specs = {
            "qweight": TensorSpec((out_features, num_words(in_features, self.bits)), torch.int32),
            "scales": TensorSpec((out_features, num_groups), self.dtype),
        }
        if not self.symmetric:
            specs["qzeros"] = TensorSpec((out_features, num_words(num_groups, self.bits)), torch.int32)
        if self.has_g_idx:
            specs["g_idx"] = TensorSpec((in_features,), torch.int32)
        return specs

    def pack(self, q: QuantizedWeight) -> dict[str, Tensor]:
        self._check_weight(q)
        if self.is_gpu_layout:  # symmetric weights carry no zeros (_check_weight); asymmetric may omit them
            zeros = q.zeros
            if zeros is None and not self.symmetric:
                zeros = torch.full_like(q.scales, 2 ** (self.bits - 1), dtype=torch.int32)
            if not self.has_g_idx:
                return pack_w4a16_for_gpu(q.qweight, q.scales.to(self.dtype), zeros)
            perm = self._group_order(q)
            return pack_w4a16_for_gpu(q.qweight[:, perm], q.scales.to(self.dtype), zeros) | {"perm": perm}
        params = {
            "qweight": pack_words(q.qweight, self.bits, dim=1),
            "scales": q.scales.to(self.dtype).contiguous(),
        }
        if not self.symmetric:
            zeros = (
                q.zeros
                if q.zeros is not None
                else torch.full_like(q.scales, 2 ** (self.bits - 1), dtype=torch.int32)
            )
            params["qzeros"] = pack_words(zeros, self.bits, dim=1)
        if self.has_g_idx:
            params["g_idx"] = q.column_groups().to(torch.int32).contiguous()
        return params

    def _group_order(self, q: QuantizedWeight) -> Tensor:
        """int32 [in]: the input columns sorted by group (stable), which must make the groups contiguous."""
        g_idx = q.column_groups()
        perm = torch.argsort(g_idx.to(torch.int64), stable=True)
        if not torch.equal(g_idx.to(torch.int32)[perm], default_g_idx(q.in_features, self.group_size, g_idx.device)):
            raise RecipeError(f"act-order groups (g_idx) of unequal sizes cannot be packed for the W4A16 kernels "
                              f"(each of its groups must hold {self.group_size} columns); build for target.device: cpu")
        return perm.to(torch.int32).contiguous()

    def _check_weight(self, q: QuantizedWeight) -> None:
        if q.bits != self.bits or q.qweight.dtype != torch.int32:
            raise RecipeError(
                f"a {q.bits}-bit {q.qweight.dtype} weight cannot be packed into {self.name}; "
                f"quantize with bits: {self.bits}"
            )
        if q.group_size != self.group_size:
            raise RecipeError(f"weight has group_size {q.group_size} but the format has {self.group_size}")
        if self.symmetric and not q.is_symmetric:
            raise RecipeError(f"weight has zero points; use symmetric: false for {self.name}")
        num_groups = num_groups_of(q.in_features, self.group_size)
        if tuple(q.scales.shape) != (q.out_features, num_groups):
            raise ValueError(f"scales {tuple(q.scales.shape)} != ({q.out_features}, {num_groups})")
        if int(q.qweight.min()) < 0 or int(q.qweight.max()) >= 2**self.bits:
            raise ValueError(f"levels outside [0, {2**self.bits}) for {self.name}")
        is_default_order = q.g_idx is None or torch.equal(
            q.g_idx.to(torch.int32), default_g_idx(q.in_features, self.group_size, q.g_idx.device)
        )
        if not self.has_g_idx and not is_default_order:
            raise RecipeError(f"weight has act-order groups (g_idx); use has_g_idx: true for {self.name}")

    def dequantize(self, params: dict[str, Tensor], in_features: int) -> Tensor:
        """Weights [out, in] float32 from this format's tensors (the CPU path of `apply`)."""
        if self.is_gpu_layout:
            weight = dequantize_w4a16(params, in_features, self.group_size)  # [out, in], columns in perm order
            if "perm" in params:  # (not there where Linear.drop_identity_perm found it the identity)
                weight = torch.empty_like(weight).index_copy_(1, params["perm"].long(), weight)
            return weight
        levels = unpack_words(params["qweight"], self.bits, dim=1, size=in_features)  # [out, in]
        scales = params["scales"].float()  # [out, G]
        if self.symmetric:
            zeros = torch.full_like(scales, 2 ** (self.bits - 1))
        else:
            zeros = unpack_words(params["qzeros"], self.bits, dim=1, size=scales.shape[1]).float()
        g_idx = (
            params["g_idx"] if self.has_g_idx else default_g_idx(in_features, self.group_size, levels.device)
        )
        g_idx = g_idx.long()  # [in]
        return (levels.float() - zeros[:, g_idx]) * scales[:, g_idx]

    def select_kernel(self, x: Tensor) -> Callable[..., Tensor] | None:
        """The fused GPU kernel for x's device, or None for the dequantize + matmul path.

        NOTE: the seam for the Triton int-weight GEMM (kernels/): weights in the gpu layout on CUDA
        run kernels/w4a16_gemm.py (`kernel_table`, the artifact's recorded one, picks the kernel per shape).
        """
        if self.is_gpu_layout and can_use_triton(x):
            return _w4a16_kernel
        return None

    def apply(self, x: Tensor, params: dict[str, Tensor], bias: Tensor | None) -> Tensor:
        """params["dense"], where present: the weight already dequantized (on a CPU, once at load:
        runtime/layers/linear.Linear.dequantize_once), the same values this path computes per call."""
        kernel = self.select_kernel(x)
        if kernel is not None:
            return kernel(x, params, bias, self)
        weight = params.get("dense")
        if weight is None:
            weight = self.dequantize(params, in_features=x.shape[-1]).to(x.dtype)  # [out, in]
        return F.linear(x, weight, bias)

    def interleave_gate_up(self, params: dict[str, Tensor]) -> dict[str, Tensor] | None:
        """A gate_up projection's tensors with its rows in the order `apply_silu_mul` reads (gpu layout,
        w4a16_gemm.interleave_gate_up), or None where this format keeps gate and up apart."""
        if not self.is_gpu_layout or params["qweight"].shape[1] % (2 * GATE_UP_INTERLEAVE):
            return None
        return interleave_gate_up(params)

    def apply_silu_mul(self, x: Tensor, params: dict[str, Tensor], bias: Tensor | None) -> Tensor:
        """SiLU(gate) · up [..., out / 2] of a gate_up whose tensors `interleave_gate_up` reordered: on a
        Hopper GPU in the W4A16 GEMV's epilogue (w4a16_gemm.w4a16_silu_mul); elsewhere `apply`'s product,
        then activation.silu_and_mul."""
        if self.select_kernel(x) is not None:
            return _w4a16_kernel(x, params, bias, self, silu_mul=True)
        return silu_and_mul(self.apply(x, params, bias), GATE_UP_INTERLEAVE)


def _w4a16_kernel(x: Tensor, params: dict[str, Tensor], bias: Tensor | None, fmt: IntWeightFormat,
                  silu_mul: bool = False) -> Tensor:
    if "perm" in params:  # act order: the packed weight's columns are x's in this order
        x = x.index_select(-1, params["perm"])
    return (w4a16_silu_mul if silu_mul else w4a16_linear)(
        x, params["qweight"], params["scales"], params.get("qzeros"), bias, fmt.group_size, fmt.kernel_table
    )


@dataclass(frozen=True)
class _IntFormatOfBits:
    """Registry entry for one integer-format name: `make_format` passes no name, so the bits live here."""

    bits: int

    def from_spec(self, params: dict, dtype: torch.dtype) -> IntWeightFormat:
        if params.get("bits", self.bits) != self.bits:
            raise RecipeError(
                f"format {INT_FORMAT_NAMES[self.bits]} holds {self.bits}-bit weights, "
                f"not bits {params['bits']}; use format {INT_FORMAT_NAMES.get(params['bits'], '?')}"
            )
        return IntWeightFormat.from_spec({**params, "bits": self.bits}, dtype)


@functools.cache
def _log_fp8_reference_path(device_type: str, name: str = "w8a8-fp8") -> None:
    logger.warning(
        "%s on %s has no FP8 matmul: running the reference path "
        "(weights dequantized, activations still quantized to fp8)",
        name, device_type,
    )


@dataclass(frozen=True)
class Fp8Format:
    """`w8a8-fp8`: E4M3 weights and activations, float32 scales.

    y = (x_fp8 * x_scale) @ (weight * weight_scale).T + bias, where x_fp8, x_scale come from dynamic
    per-token quantization (x_scale [..., 1] = absmax of the token / 448) or, if is_static_input,
    from the calibrated input_scale.

    Tensors:
      weight        float8_e4m3fn [out, in]
      weight_scale  float32 [out, 1] if is_per_channel else [1, 1]
      input_scale   float32 [1]   only if is_static_input
    """

    dtype: torch.dtype
    is_per_channel: bool = True
    is_static_input: bool = False
    name: str = "w8a8-fp8"

    @classmethod
    def from_spec(cls, params: dict, dtype: torch.dtype) -> "Fp8Format":
        known = {"is_per_channel", "is_static_input"}
        if unknown := sorted(set(params) - known):
            raise RecipeError(f"unknown w8a8-fp8 field(s) {unknown}; known: {sorted(known)}")
        return cls(dtype, **params)

    def spec(self) -> dict:
        return {
            "format": self.name,
            "is_per_channel": self.is_per_channel,
            "is_static_input": self.is_static_input,
        }

    def param_specs(self, in_features: int, out_features: int) -> dict[str, TensorSpec]:
        specs = {
            "weight": TensorSpec((out_features, in_features), FP8_DTYPE),
            "weight_scale": TensorSpec((out_features if self.is_per_channel else 1, 1), torch.float32),
        }
        if self.is_static_input:
            specs["input_scale"] = TensorSpec((1,), torch.float32)
        return specs

    def pack(self, q: QuantizedWeight) -> dict[str, Tensor]:
        if q.qweight.dtype != FP8_DTYPE:
            raise RecipeError(
                f"a {q.qweight.dtype} weight cannot be packed into w8a8-fp8; quantize it to fp8"
            )
        scales = q.scales.float()
        if self.is_per_channel and scales.shape == (1, 1):  # a per-tensor scale expands losslessly
            scales = scales.expand(q.out_features, 1)
        expected_scale = (q.out_features if self.is_per_channel else 1, 1)
        if tuple(scales.shape) != expected_scale:
            raise RecipeError(
                f"weight scales {tuple(scales.shape)} do not match is_per_channel="
                f"{self.is_per_channel}; expected {expected_scale}"
            )
        if self.is_static_input and q.input_scale is None:
            raise RecipeError("w8a8-fp8 with static input scales needs calibration (input_scale is missing)")
        params = {"weight": q.qweight.contiguous(), "weight_scale": scales.contiguous()}
        if self.is_static_input:
            params["input_scale"] = q.input_scale.float().reshape(1).contiguous()
        return params

    def quantize_input(self, x: Tensor, params: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """(x_fp8 [..., in], x_scale [..., 1] per token or [1] static)."""
        if self.is_static_input:
            return quantize_fp8_static(x, params["input_scale"])
        return fp8_kernels.quantize_fp8_per_token(x)  # one fused Triton kernel on CUDA

    @property
    def takes_fp8_activations(self) -> bool:
        """Whether `apply` may be handed an `Fp8Activation` (quantized per token by the kernel before, as
        `quantize_input` would): dynamic input scales only."""
        return not self.is_static_input

    def note_device(self, params: dict[str, Tensor]) -> None:
        """Once the weights have loaded: say now (not in the middle of the first output) when this device
        has no FP8 matmul for them."""
        if not fp8_kernels.can_use_scaled_mm(params["weight"], params["weight"]):
            _log_fp8_reference_path(params["weight"].device.type)

    def dequantize(self, params: dict[str, Tensor], in_features: int | None = None) -> Tensor:
        """Weights [out, in] float32."""
        return params["weight"].float() * params["weight_scale"].float()

    def apply(self, x: Tensor | fp8_kernels.Fp8Activation, params: dict[str, Tensor], bias: Tensor | None) -> Tensor:
        """params["dense"], where present: the weight dequantized once (on a CPU: Linear.dequantize_once)."""
        if isinstance(x, fp8_kernels.Fp8Activation):
            x_fp8, x_scale, out_dtype = x
        else:
            (x_fp8, x_scale), out_dtype = self.quantize_input(x, params), x.dtype
        weight = params["weight"]  # [out, in]
        if not fp8_kernels.can_use_scaled_mm(x_fp8, weight):
            _log_fp8_reference_path(x_fp8.device.type)
        return fp8_kernels.fp8_matmul(x_fp8, x_scale, weight, params["weight_scale"], bias, out_dtype,
                                      params.get("dense"))


def is_fp8_block_size(block) -> bool:
    """Whether `block` is a [rows, columns] w8a8-fp8-block can hold: two powers of two >= 16 (its activation groups
    are the columns, split by the kernels' 16-wide tiles)."""
    return (isinstance(block, (list, tuple)) and len(block) == 2
            and all(type(b) is int and b >= 16 and b & (b - 1) == 0 for b in block))


@dataclass(frozen=True)
class Fp8BlockFormat:
    """`w8a8-fp8-block`: E4M3 weights quantized in blocks of block_size = (rows, columns), 128 x 128 by default
    (DeepSeek-V3's, Qwen3's FP8 checkpoints, llm-compressor's FP8_BLOCK), and E4M3 activations quantized per
    token and per `columns` inputs at run time.

    y = (x_fp8 · x_scale) @ (weight · weight_scale).T + bias, each scale applying to its group of `columns`
    inputs. The weight scales are stored per row (the rows of one block repeat its scale), so fused q/k/v and
    gate/up rows, and tensor-parallel shards of them, need not fall on block edges.

    Tensors:
      weight        float8_e4m3fn [out, in]
      weight_scale  float32 [out, ceil(in / columns)]
    """

    dtype: torch.dtype
    block_size: tuple[int, int] = (128, 128)
    name: str = "w8a8-fp8-block"

    @classmethod
    def from_spec(cls, params: dict, dtype: torch.dtype) -> "Fp8BlockFormat":
        if unknown := sorted(set(params) - {"block_size"}):
            raise RecipeError(f"unknown w8a8-fp8-block field(s) {unknown}; known: ['block_size']")
        block = params.get("block_size", (128, 128))
        if not is_fp8_block_size(block):
            raise RecipeError(f"w8a8-fp8-block block_size {block!r}: give [rows, columns], powers of two >= 16")
        return cls(dtype, tuple(block))

    @property
    def group_size(self) -> int:
        """Inputs per scale (the block's columns)."""
        return self.block_size[1]

    def spec(self) -> dict:
        return {"format": self.name, "block_size": list(self.block_size)}

    def param_specs(self, in_features: int, out_features: int) -> dict[str, TensorSpec]:
        return {"weight": TensorSpec((out_features, in_features), FP8_DTYPE),
                "weight_scale": TensorSpec((out_features, -(-in_features // self.group_size)), torch.float32)}

    def pack(self, q: QuantizedWeight) -> dict[str, Tensor]:
        groups = -(-q.in_features // self.group_size)
        if q.qweight.dtype != FP8_DTYPE or q.group_size != self.group_size or tuple(q.scales.shape) != (q.out_features, groups):
            raise RecipeError(f"a {q.qweight.dtype} weight with scales {tuple(q.scales.shape)} (group_size {q.group_size}) "
                              f"cannot be packed into w8a8-fp8-block {list(self.block_size)}: it holds fp8 weights with "
                              f"scales [{q.out_features}, {groups}]")
        return {"weight": q.qweight.contiguous(), "weight_scale": q.scales.float().contiguous()}

    def dequantize(self, params: dict[str, Tensor], in_features: int | None = None) -> Tensor:
        """Weights [out, in] float32."""
        weight = params["weight"]
        return weight.float() * fp8_kernels.expand_group_scales(params["weight_scale"].float(), self.group_size,
                                                                weight.shape[1])

    def quantize_input(self, x: Tensor, params: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """(x_fp8 [..., in], x_scale [..., ceil(in / columns)])."""
        return fp8_kernels.quantize_fp8_per_token_group(x, self.group_size)

    def note_device(self, params: dict[str, Tensor]) -> None:
        """Say at load when this device runs the reference path: no FP8 tensor cores, or no triton (both the group
        quantization and the few-token kernel are Triton's; fp8_block_matmul then computes in float32)."""
        if not (fp8_kernels.has_fp8_tensor_cores(params["weight"]) and fp8_kernels.is_triton_installed()):
            _log_fp8_reference_path(params["weight"].device.type, self.name)

    def derived_params(self, params: dict[str, Tensor]) -> dict[str, Tensor]:
        """Once the weights have loaded on a GPU with FP8 tensor cores, the weight scales as cuBLAS's block-scaled
        GEMM reads them (kernels/fp8.block_scaled_mm): `weight_scale_blocks` [out / 128, groups], one row per
        128-row block, where the rows of each block share their scales (kernels/fp8.block_scales); and
        `weight_scale_rows`, the per-row scales with the rows contiguous (strides (1, out)), for up to 64 tokens,
        except on outputs of 16384 and more that have blocks (gate_up: blocks are faster there), or always where
        there are no blocks. A copy: the Triton kernel reads the stored layout faster (session 43, call 6). Nothing
        on other devices; nothing for groups other than 128 or outputs not a multiple of 4 (cuBLAS's)."""
        scale = params["weight_scale"]
        rows = scale.shape[0]
        if not fp8_kernels.has_fp8_tensor_cores(params["weight"]) or self.group_size != 128 or rows % 4:
            return {}
        blocks = fp8_kernels.block_scales(scale, self.group_size)
        derived = {} if blocks is None else {"weight_scale_blocks": blocks}
        if blocks is None or rows < fp8_kernels.BLOCK_ROW_SCALES_MAX_OUT:
            derived["weight_scale_rows"] = scale.t().contiguous().t()
        return derived

    def apply(self, x: Tensor, params: dict[str, Tensor], bias: Tensor | None) -> Tensor:
        """params["dense"], where present: the weight dequantized once (on a CPU: Linear.dequantize_once)."""
        return fp8_kernels.fp8_block_linear(x, params["weight"], params["weight_scale"], self.group_size, bias,
                                            params.get("weight_scale_rows"), params.get("weight_scale_blocks"),
                                            params.get("dense"))


@dataclass(frozen=True)
class Int8W8A8Format:
    """`w8a8-int8`: int8 weights, symmetric, one scale per output channel; activations int8, symmetric,
    one scale per token computed at run time (llm-compressor's W8A8 scheme, vLLM's dynamic int8).

    y = (x_int8 @ weight.T) * x_scale * weight_scale.T + bias with x_int8, x_scale from
    kernels/int8.quantize_int8_per_token (scale = absmax / 127 per token, round half to even, ±127).
    The weight is the symmetric 8-bit QuantizedWeight of the integer algorithms (levels [0, 256), zero
    128, per channel: RTN's and GPTQ's scale = absmax / 127.5, compressed-tensors' convention) stored signed.

    Tensors:
      weight        int8 [out, in]      level - 128, in [-128, 127]
      weight_scale  float32 [out, 1]
    """

    dtype: torch.dtype
    name: str = "w8a8-int8"

    @classmethod
    def from_spec(cls, params: dict, dtype: torch.dtype) -> "Int8W8A8Format":
        if params:
            raise RecipeError(f"unknown w8a8-int8 field(s) {sorted(params)}; the format has none (per-channel "
                              "weights, per-token dynamic activations)")
        return cls(dtype)

    def spec(self) -> dict:
        return {"format": self.name}

    def param_specs(self, in_features: int, out_features: int) -> dict[str, TensorSpec]:
        return {"weight": TensorSpec((out_features, in_features), torch.int8),
                "weight_scale": TensorSpec((out_features, 1), torch.float32)}

    def pack(self, q: QuantizedWeight) -> dict[str, Tensor]:
        if q.bits != 8 or q.qweight.dtype != torch.int32 or q.group_size != -1 or not q.is_symmetric:
            raise RecipeError(f"a {q.bits}-bit {q.qweight.dtype} weight (group_size {q.group_size}, "
                              f"{'symmetric' if q.is_symmetric else 'with zero points'}) cannot be packed into "
                              "w8a8-int8; it holds symmetric 8-bit weights with one scale per output channel")
        if q.g_idx is not None and bool((q.g_idx != 0).any()):
            raise RecipeError("w8a8-int8 holds one group per output channel; the weight has act-order groups")
        if tuple(q.scales.shape) != (q.out_features, 1):
            raise ValueError(f"scales {tuple(q.scales.shape)} != ({q.out_features}, 1)")
        if int(q.qweight.min()) < 0 or int(q.qweight.max()) > 255:
            raise ValueError("levels outside [0, 256) for w8a8-int8")
        return {"weight": (q.qweight - 128).to(torch.int8).contiguous(),
                "weight_scale": q.scales.float().contiguous()}

    def dequantize(self, params: dict[str, Tensor], in_features: int | None = None) -> Tensor:
        """Weights [out, in] float32 (what the artifact's weights stand for; activations aside)."""
        return params["weight"].float() * params["weight_scale"].float()

    def apply(self, x: Tensor, params: dict[str, Tensor], bias: Tensor | None) -> Tensor:
        return int8_linear(x, params["weight"], params["weight_scale"], bias)


_FORMATS: dict[str, object] = {
    "dense": DenseFormat,
    "w8a8-fp8": Fp8Format,
    "w8a8-fp8-block": Fp8BlockFormat,
    "w8a8-int8": Int8W8A8Format,
    **{name: _IntFormatOfBits(bits) for bits, name in INT_FORMAT_NAMES.items()},
}


def dequantizes_once_on_cpu(fmt: LinearFormat) -> bool:
    """Whether a CPU holds this format's weights dequantized once at load (Linear.dequantize_once): the integer
    weight-only formats (the CPU's only int path) and the FP8 ones (whose CPU path is the reference: the same
    weights, its activations still rounded to FP8); not w8a8-int8, whose CPU path multiplies the int8 levels."""
    return isinstance(fmt, (IntWeightFormat, Fp8Format, Fp8BlockFormat))


def takes_fp8_activations(fmt: LinearFormat) -> bool:
    """Whether fmt.apply takes an `Fp8Activation` (w8a8-fp8 with per-token input scales): the kernel that
    makes such a linear's input then quantizes it too (norm.rms_norm_fp8, activation.act_and_mul_fp8)."""
    return getattr(fmt, "takes_fp8_activations", False)


def register_format(name: str, cls: object) -> None:
    """Register a format: `cls` is anything with `from_spec(params, dtype) -> LinearFormat`."""
    _FORMATS[name] = cls


def make_format(spec: dict, dtype: torch.dtype) -> LinearFormat:
    """Rebuild a format from its manifest spec (`{"format": "dense"}`, `{"format": "w4a16", ...}`).

    `dtype` is the model's activation dtype (the dtype of dense weights, scales' compute dtype).
    """
    name = spec["format"]
    if name not in _FORMATS:
        raise KeyError(f"unknown weight format {name!r}; known: {sorted(_FORMATS)}")
    params = {k: v for k, v in spec.items() if k != "format"}
    return _FORMATS[name].from_spec(params, dtype)
