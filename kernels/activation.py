"""SiLU(gate) · up on the fused gate_up projection.

Shapes: gate_up [num_tokens, 2 * intermediate_size] → [num_tokens, intermediate_size].
On CUDA one Triton kernel (activation_triton.py); elsewhere plain torch.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from . import can_use_triton


def silu_and_mul(gate_up: Tensor) -> Tensor:
    if can_use_triton(gate_up):
        from . import activation_triton  # triton loads on the first CUDA call only

        return activation_triton.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
