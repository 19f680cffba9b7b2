"""Rotary embedding tables, including Llama 3's frequency scaling (`rope_type: llama3`), linear scaling,
YaRN (`rope_type: yarn`, Qwen2.5/Qwen3's long-context setting: frequencies blended by a ramp over
the head dimensions, cos and sin scaled by its attention factor) and Phi-3's LongRoPE within its original
context (`rope_type: longrope`: the short factors and the attention factor), as transformers computes them."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from llmc.errors import CheckpointError, ConfigError


def inv_frequencies(head_dim: int, theta: float, rope_scaling: dict | None) -> Tensor:
    """[head_dim / 2] float64 inverse frequencies, scaled as the checkpoint's rope_scaling says. `head_dim` is the
    rotated dims (ModelConfig.rotary_dims: fewer than the head's under a partial_rotary_factor, as transformers
    computes the frequencies over them)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "llama3":
        return _llama3_scaled(inv_freq, rope_scaling)
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "yarn":
        return _yarn_scaled(inv_freq, head_dim, theta, rope_scaling)
    if rope_type == "longrope":  # Phi-3's: the short factors, which hold within original_max_position_embeddings
        short = torch.tensor(rope_scaling["short_factor"], dtype=torch.float64)
        if short.shape != inv_freq.shape:
            raise CheckpointError(f"rope_scaling short_factor has {short.numel()} entries; the {head_dim} rotated dims "
                                  f"of a head need {inv_freq.numel()}; fix the checkpoint's config")
        return inv_freq / short
    raise CheckpointError(f"rope_scaling type {rope_type!r} is not supported; supported: default, linear, llama3, "
                          "yarn, longrope")


def _yarn_scaled(inv_freq: Tensor, head_dim: int, theta: float, cfg: dict) -> Tensor:
    """YaRN's inverse frequencies (float64): the fast dimensions (more than beta_fast rotations over the
    original context) keep theirs, the slow ones (under beta_slow) are divided by `factor`, and the band
    between is a linear ramp of the two."""
    factor, original = cfg["factor"], cfg["original_max_position_embeddings"]
    beta_fast, beta_slow = cfg.get("beta_fast") or 32, cfg.get("beta_slow") or 1

    def dimension(num_rotations: float) -> float:  # the dimension that turns num_rotations times over `original`
        return head_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(beta_fast), dimension(beta_slow)
    if cfg.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def attention_factor(rope_scaling: dict | None) -> float:
    """The factor YaRN scales cos and sin by (1 for every other rope type): its `attention_factor`, else
    0.1 ln(factor) + 1, or the ratio of two such terms with `mscale` and `mscale_all_dim` (DeepSeek's form)."""
    if (rope_scaling or {}).get("rope_type") == "longrope":  # set when the config is read (hf_checkpoint._phi3_rope)
        return float(rope_scaling["attention_factor"])
    if (rope_scaling or {}).get("rope_type") != "yarn":
        return 1.0
    if rope_scaling.get("attention_factor") is not None:
        return float(rope_scaling["attention_factor"])
    factor = rope_scaling["factor"]

    def mscale(scale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    if rope_scaling.get("mscale") and rope_scaling.get("mscale_all_dim"):
        return mscale(rope_scaling["mscale"]) / mscale(rope_scaling["mscale_all_dim"])
    return mscale(1.0)


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


def model_context(max_position_embeddings: int, rope_scaling: dict | None) -> tuple[int, str]:
    """(the longest context the model's positions support, how it comes about) as vLLM derives it
    (`_get_and_verify_max_len`): max_position_embeddings, times `factor` under linear scaling; YaRN's
    original_max_position_embeddings times `factor`; llama3 (its max_position_embeddings is already the
    long context): unscaled."""
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "linear":
        return (int(max_position_embeddings * rope_scaling["factor"]),
                f"max_position_embeddings {max_position_embeddings} x linear rope factor {rope_scaling['factor']}")
    if rope_type == "yarn":
        original = rope_scaling["original_max_position_embeddings"]
        return (int(original * rope_scaling["factor"]),
                f"yarn original_max_position_embeddings {original} x factor {rope_scaling['factor']}")
    if rope_type == "longrope":  # past it transformers rotates the whole sequence by the long factors
        original = rope_scaling["original_max_position_embeddings"]
        return (original, f"LongRoPE's original_max_position_embeddings {original}: past it transformers switches "
                          "the whole sequence to the long factors, which keys already in a paged KV cache cannot follow")
    return max_position_embeddings, f"max_position_embeddings {max_position_embeddings}"


def cos_sin_cache(head_dim: int, max_positions: int, theta: float, rope_scaling: dict | None,
                  width: int | None = None) -> Tensor:
    """[max_positions, width] float32: cos of each angle in the first half, sin in the second. `head_dim`: the
    rotated dims (ModelConfig.rotary_dims); a table narrower than the heads rotates only their leading dims. `width`
    (ModelConfig.rotary_table_dims, GLM-4's whole head): the pairs past head_dim / 2 rotate by 0 (cos 1, sin 0
    exactly: the rotation passes those dims unchanged); None: head_dim."""
    inv_freq = inv_frequencies(head_dim, theta, rope_scaling).float()
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [max_positions, head_dim/2]
    factor = attention_factor(rope_scaling)
    cos, sin = angles.cos() * factor, angles.sin() * factor
    if width is not None and width > head_dim:
        passed = (max_positions, (width - head_dim) // 2)
        cos, sin = torch.cat((cos, torch.ones(passed)), dim=-1), torch.cat((sin, torch.zeros(passed)), dim=-1)
    return torch.cat((cos, sin), dim=-1)


def partial_rotary_problem(config, device_type: str) -> str | None:
    """Why a model (a ModelConfig) with a partial rotary (rotary_dim < head_dim, Phi-4-mini's
    partial_rotary_factor) cannot run on this device type: the CUDA kernels rotate whole heads. None where it can
    (the CPU torch path rotates the leading rotary_dim dims, as does onnx-cpu's GroupQueryAttention)."""
    if device_type != "cuda" or not config.is_partial_rotary:
        return None
    return (f"{config.architecture}: partial_rotary_factor (rotary on {config.rotary_dims} of head_dim "
            f"{config.head_dim}'s dims) is not supported on CUDA, whose kernels rotate whole heads; it runs on a CPU: "
            "build with target.device cpu (llmc run --device cpu) or onnx-cpu")


def check_rotary_device(config, device: torch.device) -> None:
    """Refuse by name, at engine start, a partial-rotary model on CUDA (partial_rotary_problem)."""
    if problem := partial_rotary_problem(config, device.type):
        raise ConfigError(problem)


def query_temperature(positions: Tensor, beta: float, floor: float, offset: float) -> Tensor:
    """[num_tokens] float32: 1 + beta * log(1 + floor((position + offset) / floor)), the factor q is multiplied by at
    each position (Ministral 3, Mistral 4: offset 0, floor original_max_position_embeddings; Llama 4: offset 1,
    floor_scale).
    Device ops on the step's positions: a CUDA graph computes it from its positions buffer at every replay."""
    return 1 + beta * torch.log(1 + torch.floor((positions.float() + offset) / floor))
