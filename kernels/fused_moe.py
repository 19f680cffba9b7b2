"""Fused mixture-of-experts MLP: tokens sorted by expert, one grouped GEMM for gate_up and one for
down, the routing weights applied in the down GEMM and the top-k copies summed.

Shapes: x [M, H]; topk_weights [M, k] float32; topk_ids [M, k] int64, local expert indices (ids
outside [0, E) belong to another rank's experts and contribute nothing); w_gate_up [E, 2I, H],
w_down [E, H, I] in x's dtype, or float8_e4m3fn with per-output-channel scales [E, 2I] / [E, H]
(float32; value = fp8 * scale). Output [M, H] in x's dtype.

`align_by_expert` is plain torch and never synchronises with the host (no .item(), no boolean
indexing), so the whole op can be captured in a CUDA graph: its buffers have static sizes, bounded
by M·k + E·(BLOCK_M − 1) sorted slots. On CPUs, `fused_moe_reference` is the same computation,
expert by expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import can_use_triton

BLOCK_M = 16  # sorted (token, expert) slots per program: each expert's run is padded to a multiple


def align_by_expert(topk_ids: Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[Tensor, Tensor]:
    """(sorted_pairs [S] int32, block_expert [S / block_m] int32), S = round_up(P + E·(block_m − 1), block_m),
    P = M·k. sorted_pairs lists pair indices p (token p // k, slot p % k) expert by expert, each expert's
    run padded to a multiple of block_m with P (no pair); block_expert gives each block's expert, E
    for blocks past the last run (skipped)."""
    flat = topk_ids.flatten()
    num_pairs = flat.numel()
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # other ranks' experts → E
    order = torch.argsort(key, stable=True)  # [P] pair indices, by expert
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts] = 0  # dropped pairs get no slots
    padded_start = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    num_slots = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_key = key[order]
    slot = padded_start[sorted_key] + torch.arange(num_pairs, device=flat.device) - start[sorted_key]
    slot = torch.where(sorted_key < num_experts, slot, num_slots)  # dropped: the dump slot past the end
    sorted_pairs = torch.full((num_slots + 1,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs.scatter_(0, slot, order.to(torch.int32))
    ends = torch.cumsum(padded[:num_experts], 0)
    blocks = torch.arange(num_slots // block_m, device=flat.device) * block_m
    block_expert = torch.searchsorted(ends, blocks, right=True).to(torch.int32)  # E past the last run
    return sorted_pairs[:num_slots], block_expert


def fused_moe(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, w_gate_up: Tensor, w_down: Tensor,
              gate_up_scale: Tensor | None = None, down_scale: Tensor | None = None) -> Tensor:
    """The MoE MLP of x [M, H] (see the module docstring): Triton on CUDA, else the torch reference."""
    if not can_use_triton(x):
        return fused_moe_reference(x, topk_weights, topk_ids, w_gate_up, w_down, gate_up_scale, down_scale)
    from . import fused_moe_triton  # triton loads on the first CUDA call only

    return fused_moe_triton.fused_moe(x, topk_weights, topk_ids, w_gate_up, w_down, gate_up_scale, down_scale)


def fused_moe_reference(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, w_gate_up: Tensor, w_down: Tensor,
                        gate_up_scale: Tensor | None = None, down_scale: Tensor | None = None) -> Tensor:
    """Expert by expert in plain torch, in x's dtype (float32 accumulation for FP8 weights)."""
    out = torch.zeros_like(x)
    for expert in range(w_gate_up.shape[0]):
        token, slot = torch.where(topk_ids == expert)
        if token.numel() == 0:
            continue
        w1, w2 = _weight(w_gate_up, gate_up_scale, expert, x.dtype), _weight(w_down, down_scale, expert, x.dtype)
        gate, up = F.linear(x[token], w1).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2)
        out.index_add_(0, token, y * topk_weights[token, slot, None].to(y.dtype))
    return out


def _weight(w: Tensor, scale: Tensor | None, expert: int, dtype: torch.dtype) -> Tensor:
    return w[expert].to(dtype) if scale is None else (w[expert].float() * scale[expert].float()[:, None]).to(dtype)
