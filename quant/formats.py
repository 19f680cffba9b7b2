"""What a quantized weight IS: one `LinearFormat` per format, keyed by name (DESIGN §3).

Algorithms (RTN, GPTQ, AWQ, FP8 scaling, importers) produce a `QuantizedWeight`; a format packs it
into the artifact's tensors at compile time (`pack`) and runs a linear layer on them at run time
(`apply`). The runtime dispatches on the format and never learns which algorithm made a weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one artifact tensor of a linear layer."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class QuantizedWeight:
    """A quantized weight in plain, unpacked form: the meeting point of algorithms, importers and formats.

    Integer formats: w[o, i] = (qweight[o, i] - zeros[o, g_idx[i]]) * scales[o, g_idx[i]].
    FP8: w[o, i] = qweight[o, i].float() * scales[o, 0]  (per-channel) or * scales[0, 0] (per-tensor).
    """

    qweight: Tensor  # [out_features, in_features] int32 levels in [0, 2**bits) (int) | float8_e4m3fn (fp8)
    scales: Tensor  # [out_features, num_groups] float32 (int) | [out_features, 1] or [1, 1] float32 (fp8)
    zeros: Tensor | None  # [out_features, num_groups] int32 levels; None = symmetric (zero = 2**(bits-1))
    bits: int
    group_size: int  # -1 = one group spanning the whole input dimension (per output channel)
    g_idx: Tensor | None = None  # [in_features] int32 group of each input column (act-order); None = i // group_size
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


_FORMATS: dict[str, type] = {"dense": DenseFormat}


def register_format(name: str, cls: type) -> None:
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
