"""A linear layer whose weights are in some `LinearFormat` (dense, w4a16, w8a8-fp8, ...).

The layer never knows which algorithm made its weights: it holds the format's tensors as buffers
named by `param_specs` (so the state_dict keys are the artifact's tensor names) and calls `apply`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from llmc.kernels.fp8 import Fp8Activation
from llmc.quant.formats import LinearFormat, dequantizes_once_on_cpu


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, fmt: LinearFormat, has_bias: bool, dtype: torch.dtype):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.fmt = fmt
        self.param_names = []
        for name, spec in fmt.param_specs(in_features, out_features).items():
            self.register_buffer(name, torch.empty(spec.shape, dtype=spec.dtype, device="meta"))
            self.param_names.append(name)
        self.has_bias = has_bias
        if has_bias:
            self.register_buffer("bias", torch.empty(out_features, dtype=dtype, device="meta"))
        self.dense: Tensor | None = None  # an int weight dequantized once, on a CPU (dequantize_once)
        self.lora = None  # run-time LoRA slots (runtime/lora.LinearLora), added to the output; None: none

    def forward(self, x: Tensor | Fp8Activation) -> Tensor:
        out = self.fmt.apply(x, self.params(), self.bias if self.has_bias else None)
        return out if self.lora is None else self.lora.add_to(out, x)

    def params(self) -> dict[str, Tensor]:
        params = {name: getattr(self, name) for name in self.param_names}
        return params if self.dense is None else {**params, "dense": self.dense}

    def dense_bytes(self) -> int:
        """What dequantize_once would hold: an int-weight or FP8 format's weight in the compute dtype, on a CPU
        (0 for other formats, and on GPUs; quant/formats.dequantizes_once_on_cpu)."""
        if not dequantizes_once_on_cpu(self.fmt) or getattr(self, self.param_names[0]).device.type != "cpu":
            return 0
        return self.out_features * self.in_features * self.fmt.dtype.itemsize

    def dequantize_once(self) -> None:
        """On a CPU, after the weights load (and after interleave_gate_up): an int-weight or FP8 format's
        weight dequantized once into the compute dtype, which `apply` then multiplies by, instead of
        dequantizing it in every forward (the CPU's only int path: ~8x slower decode; FP8's reference path
        4-7x, session 43). Only where dense_bytes() > 0."""
        self.dense = self.fmt.dequantize(self.params(), self.in_features).to(self.fmt.dtype)

    def derive_params(self) -> None:
        """Tensors the format computes once from the loaded ones for this device (Fp8BlockFormat.derived_params),
        added to `params()` (as buffers outside the state dict: the artifact does not hold them)."""
        derive = getattr(self.fmt, "derived_params", None)
        for name, tensor in (derive(self.params()) if derive is not None else {}).items():
            self.register_buffer(name, tensor, persistent=False)
            self.param_names.append(name)

    def interleave_gate_up(self) -> bool:
        """A gate_up projection's rows reordered for `silu_mul`, once, after its weights load: whether
        the format does that (IntWeightFormat.interleave_gate_up; other formats, and a layer with a bias,
        keep their order)."""
        interleave = getattr(self.fmt, "interleave_gate_up", None)
        params = interleave(self.params()) if interleave is not None and not self.has_bias else None
        if params is None:
            return False
        for name, tensor in params.items():
            setattr(self, name, tensor)
        return True

    def drop_identity_perm(self) -> bool:
        """An act-order weight whose packed columns are in x's own order (the build ordered an act-order
        down projection's groups: compiler/shard.order_down_groups) gathers no x per forward: its `perm`,
        the identity, leaves `params()`, once, after the weights load. Whether it did."""
        perm = getattr(self, "perm", None) if "perm" in self.param_names else None
        if perm is None or not torch.equal(perm, torch.arange(perm.numel(), dtype=perm.dtype, device=perm.device)):
            return False
        self.param_names.remove("perm")
        return True

    def take_perm(self) -> Tensor | None:
        """An act-order weight's `perm` taken out of `params()` by the one who will hand this linear x
        already in that order (RMSNorm.take_linear_perm); None where there is none."""
        if "perm" not in self.param_names:
            return None
        self.param_names.remove("perm")
        return self.perm

    def silu_mul(self, x: Tensor) -> Tensor:
        """SiLU(gate) · up of this gate_up projection, after `interleave_gate_up`."""
        return self.fmt.apply_silu_mul(x, self.params(), self.bias if self.has_bias else None)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, format={self.fmt.spec()}"
