"""SiLU(gate) · up on the fused gate_up projection.

Shapes: gate_up [num_tokens, 2 * intermediate_size] → [num_tokens, intermediate_size].
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def silu_and_mul(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
