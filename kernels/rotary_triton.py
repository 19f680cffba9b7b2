"""Triton rotary embedding, in place on q and k (imported only when a kernel runs).

One program per (token, q or k): all heads of that token as one [BLOCK_H, head_dim / 2] tile pair,
cos and sin read once per token. Strided q/k views (slices of the fused qkv output) are fine.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from .pdl_triton import pdl_args, wait_for_inputs


@triton.jit
def _rotate_heads(x_ptr, token, num_heads, stride_t, stride_h, cos, sin, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    offs_h, offs_d = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_HALF)
    mask = (offs_h < num_heads)[:, None] & (offs_d < HALF)[None, :]
    ptrs = x_ptr + token * stride_t + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptrs + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, pos_ptr, cos_sin_ptr, num_heads, num_kv_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_inputs(PDL)
    token, is_k = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_HALF)
    position = tl.load(pos_ptr + token)
    cos = tl.load(cos_sin_ptr + position * stride_cs + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + position * stride_cs + HALF + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
    if is_k == 0:
        _rotate_heads(q_ptr, token, num_heads, stride_qt, stride_qh, cos[None, :], sin[None, :], HALF, BLOCK_H, BLOCK_HALF)
    else:
        _rotate_heads(k_ptr, token, num_kv_heads, stride_kt, stride_kh, cos[None, :], sin[None, :], HALF, BLOCK_H, BLOCK_HALF)


def apply_rotary_(q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor) -> tuple[Tensor, Tensor]:
    """Rotates q [num_tokens, num_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim] in place."""
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("apply_rotary_ needs unit stride along head_dim")
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return q, k
    half = head_dim // 2
    _rotary_kernel[(num_tokens, 2)](
        q, k, positions, cos_sin_cache, num_heads, k.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        HALF=half, BLOCK_H=triton.next_power_of_2(max(num_heads, k.shape[1])),
        BLOCK_HALF=triton.next_power_of_2(half), **pdl_args(q.device),
    )
    return q, k
