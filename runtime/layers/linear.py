"""A linear layer whose weights are in some `LinearFormat` (dense, w4a16, w8a8-fp8, ...).

The layer never knows which algorithm made its weights: it holds the format's tensors as buffers
named by `param_specs` (so the state_dict keys are the artifact's tensor names) and calls `apply`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from llmc.quant.formats import LinearFormat


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

    def forward(self, x: Tensor) -> Tensor:
        params = {name: getattr(self, name) for name in self.param_names}
        return self.fmt.apply(x, params, self.bias if self.has_bias else None)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, format={self.fmt.spec()}"
