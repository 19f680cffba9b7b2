"""SiLU(gate) · up on the fused gate_up projection (and GELU(gate) · up, tanh form, for Gemma: `act_and_mul`).

Shapes: gate_up [num_tokens, 2 * intermediate_size] → [num_tokens, intermediate_size].
Column order: gate then up (`interleave` 0), or gate and up alternating in runs of `interleave`
columns (GATE_UP_INTERLEAVE: columns 16 q ... 16 q + 7 are gate features 8 q ... 8 q + 7, the next
eight the same features' up), the order in which a W4A16 gate_up's rows are kept on load so that
its GEMV can finish SiLU · mul in its own epilogue (w4a16_gemm.interleave_gate_up).
On CUDA one Triton kernel (activation_triton.py); elsewhere plain torch. `act_and_mul_fp8` also
quantizes the output per token for a w8a8-fp8 down projection (kernels/fp8.py), in the same kernel on CUDA.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from . import can_use_triton
from .fp8 import MIN_SCALE, ONE_PASS_MAX, Fp8Activation, quantize_fp8_per_token

GATE_UP_INTERLEAVE = 8
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # transformers' names (ModelConfig.hidden_act)


def _act(gate: Tensor, act: str) -> Tensor:
    return F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")


def act_and_mul(gate_up: Tensor, act: str = "silu", interleave: int = 0) -> Tensor:
    """act(gate) · up, act one of ACTIVATIONS (silu_and_mul's column orders)."""
    if act not in ACTIVATIONS:
        raise ValueError(f"activation {act!r}: one of {ACTIVATIONS}")
    if can_use_triton(gate_up):
        from . import activation_triton  # triton loads on the first CUDA call only

        return activation_triton.act_and_mul(gate_up, act, interleave)
    if interleave:
        pairs = gate_up.unflatten(-1, (-1, 2, interleave))  # [..., size / interleave, gate | up, interleave]
        gate, up = pairs.select(-2, 0).flatten(-2), pairs.select(-2, 1).flatten(-2)
    else:
        gate, up = gate_up.chunk(2, dim=-1)
    return _act(gate, act) * up


def act_and_mul_fp8(gate_up: Tensor, act: str = "silu", interleave: int = 0) -> Fp8Activation:
    """quantize_fp8_per_token(act_and_mul(gate_up, act)): the same values and scales, from one kernel on CUDA
    (outputs of up to ONE_PASS_MAX values per token; two kernels otherwise)."""
    if act not in ACTIVATIONS:
        raise ValueError(f"activation {act!r}: one of {ACTIVATIONS}")
    if can_use_triton(gate_up) and gate_up.shape[-1] // 2 <= ONE_PASS_MAX:
        from . import activation_triton

        return Fp8Activation(*activation_triton.act_and_mul_fp8(gate_up, MIN_SCALE, act, interleave), gate_up.dtype)
    return Fp8Activation(*quantize_fp8_per_token(act_and_mul(gate_up, act, interleave)), gate_up.dtype)


def silu_and_mul(gate_up: Tensor, interleave: int = 0) -> Tensor:
    return act_and_mul(gate_up, "silu", interleave)

