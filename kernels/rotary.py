"""Rotary position embedding in the HF (rotate-half, non-interleaved) convention.

Shapes: q [num_tokens, num_heads, head_dim], k [num_tokens, num_kv_heads, head_dim],
cos_sin_cache [max_positions, rotary_dim] (cos in the first half, sin in the second), positions [num_tokens].
rotary_dim is head_dim, or fewer (a partial_rotary_factor, Phi-4-mini): then the leading rotary_dim dims of each
head are rotated (rotate-half over them: pairs i, i + rotary_dim / 2) and the rest pass through, as transformers'
Phi-3 does. The Triton kernels rotate whole heads only (kernels/attention dispatches a narrower table here).

The plain-torch rotation (new tensors returned). On CUDA the model rotates inside the KV-cache
write's kernel (kernels/attention.rotate_and_write_kv), for which this is the test oracle.
"""

from __future__ import annotations

import torch
from torch import Tensor


def apply_rotary(q: Tensor, k: Tensor, positions: Tensor, cos_sin_cache: Tensor) -> tuple[Tensor, Tensor]:
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [num_tokens, head_dim / 2] each
    cos = cos.unsqueeze(1)  # [num_tokens, 1, head_dim / 2]
    sin = sin.unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = cos.shape[-1]
    x1, x2, rest = x.float().split((half, half, x.shape[-1] - 2 * half), dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)
    return out.to(x.dtype)
