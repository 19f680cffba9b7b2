"""Triton fused MoE (imported only when a kernel runs): a grouped GEMM over expert-sorted slots.

NOTE (algorithm): `align_by_expert` (fused_moe.py) lays the (token, expert) pairs out expert by expert,
each expert's run padded to BLOCK_M. One program computes BLOCK_M slots × BLOCK_N outputs of one
expert: it gathers the slots' input rows (x's token rows for gate_up, the pairs' own rows for down),
multiplies by that expert's weight [N, K] (FP8 weights widened to the input dtype in registers, the
per-channel scale applied to the float32 accumulator), optionally scales each row by its routing
weight, and scatters the rows to the pairs' output rows. Blocks of padding or of no expert exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .activation import silu_and_mul
from .fused_moe import BLOCK_M, align_by_expert


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, scale_ptr, c_ptr, pairs_ptr, block_expert_ptr, topk_weights_ptr,
                         num_pairs, num_experts, N, K, stride_am, stride_we, stride_wn, stride_cm,
                         A_ROWS_PER_PAIR: tl.constexpr, HAS_SCALE: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= num_experts:
        return
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    is_pair = pairs < num_pairs
    rows = (pairs // A_ROWS_PER_PAIR).to(tl.int64)  # gate_up: the pair's token; down: the pair itself
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=is_pair[:, None] & (ks[None, :] < K), other=0.0)
        w = tl.load(w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + ks[:, None],
                    mask=(offs_n[None, :] < N) & (ks[:, None] < K), other=0.0)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(a, w.to(a.dtype))
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + expert * N + offs_n, mask=offs_n < N, other=0.0)[None, :]
    if MUL_WEIGHT:
        acc *= tl.load(topk_weights_ptr + pairs, mask=is_pair, other=0.0)[:, None]
    out = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=is_pair[:, None] & (offs_n[None, :] < N))


def _grouped_gemm(a: Tensor, w: Tensor, scale: Tensor | None, out: Tensor, sorted_pairs: Tensor,
                  block_expert: Tensor, topk_weights: Tensor, rows_per_pair: int, mul_weight: bool) -> None:
    num_experts, n, k = w.shape
    block_n, block_k = 64, 32
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, scale if scale is not None else a, out, sorted_pairs, block_expert, topk_weights,
        out.shape[0], num_experts, n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_ROWS_PER_PAIR=rows_per_pair, HAS_SCALE=scale is not None, MUL_WEIGHT=mul_weight,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )


def fused_moe(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, w_gate_up: Tensor, w_down: Tensor,
              gate_up_scale: Tensor | None = None, down_scale: Tensor | None = None) -> Tensor:
    """See kernels/fused_moe.py. x [M, H] → [M, H]."""
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    x = x.contiguous()
    sorted_pairs, block_expert = align_by_expert(topk_ids, w_gate_up.shape[0])
    weights = topk_weights.float().contiguous().flatten()
    gate_up = torch.zeros(num_pairs, w_gate_up.shape[1], device=x.device, dtype=x.dtype)  # [P, 2I]
    _grouped_gemm(x, w_gate_up, gate_up_scale, gate_up, sorted_pairs, block_expert, weights, top_k, False)
    act = silu_and_mul(gate_up)  # [P, I]
    down = torch.zeros(num_pairs, w_down.shape[1], device=x.device, dtype=x.dtype)  # [P, H], other ranks' pairs 0
    _grouped_gemm(act, w_down, down_scale, down, sorted_pairs, block_expert, weights, 1, True)
    return down.view(num_tokens, top_k, -1).sum(dim=1)
