"""Rotary embedding tables, including Llama 3's frequency scaling (`rope_type: llama3`)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from llmc.errors import CheckpointError


def inv_frequencies(head_dim: int, theta: float, rope_scaling: dict | None) -> Tensor:
    """[head_dim / 2] float64 inverse frequencies, scaled as the checkpoint's rope_scaling says."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope_scaling)
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    raise CheckpointError(f"rope_scaling type {rope_type!r} is not supported; supported: default, linear, llama3")


def _llama3_scaled(inv_freq: Tensor, cfg: dict) -> Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly.
    factor, low, high = cfg["factor"], cfg["low_freq_factor"], cfg["high_freq_factor"]
    old_len = cfg["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin_cache(head_dim: int, max_positions: int, theta: float, rope_scaling: dict | None) -> Tensor:
    """[max_positions, head_dim] float32: cos of each angle in the first half, sin in the second."""
    inv_freq = inv_frequencies(head_dim, theta, rope_scaling).float()
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [max_positions, head_dim/2]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)
