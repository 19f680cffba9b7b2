"""Bit packing of integer quantization levels into int32 words: the layouts formats and importers share.

Two layouts exist in the wild:

- per-word (`pack_words`): each int32 word holds `levels_per_word(bits) = 32 // bits` whole levels
  (8 for 4 bits, 4 for 8 bits, 10 for 3 bits with the top 2 bits zero); level k of a word sits at
  bit offset `bits * k` (least significant first). The packed dim is zero-padded to whole words.
  llmc's own formats, compressed-tensors `pack-quantized` and (for 2/4/8 bits) GPTQ use it.
- bitstream (`pack_bitstream`): the levels form one little-endian bit stream along the packed dim,
  so a level may straddle two words. GPTQ's 3-bit layout (32 levels in 3 words) is this one; for
  bits dividing 32 it equals per-word.

Words are stored as int32 but mean uint32: sign is only the top bit of the last level.
"""

from __future__ import annotations

import torch
from torch import Tensor

_WORD_BITS = 32
_UINT32_MASK = 0xFFFFFFFF

# AutoAWQ GEMM stores output column 8j + AWQ_ORDER[k] in nibble k of word j.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def levels_per_word(bits: int) -> int:
    return _WORD_BITS // bits


def num_words(size: int, bits: int) -> int:
    """Words needed to hold `size` levels in the per-word layout."""
    return -(-size // levels_per_word(bits))


def _to_int32(words: Tensor) -> Tensor:
    """int64 values in [0, 2**32) → int32 with the same bits (two's complement wrap)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _to_uint(words: Tensor) -> Tensor:
    """int32 words → int64 holding the unsigned value, so right shifts do not drag the sign in."""
    return words.to(torch.int64) & _UINT32_MASK


def pack_words(levels: Tensor, bits: int, dim: int) -> Tensor:
    """Pack integer levels in [0, 2**bits) along `dim`, `32 // bits` per int32 word (zero-padded)."""
    per_word = levels_per_word(bits)
    x = levels.to(torch.int64).movedim(dim, -1)  # [..., size]
    size = x.shape[-1]
    padded = torch.nn.functional.pad(x, (0, num_words(size, bits) * per_word - size))
    shifts = bits * torch.arange(per_word, device=x.device)
    words = (padded.unflatten(-1, (-1, per_word)) << shifts).sum(-1)  # [..., num_words]
    return _to_int32(words).movedim(-1, dim).contiguous()


def unpack_words(words: Tensor, bits: int, dim: int, size: int) -> Tensor:
    """Inverse of `pack_words`: int32 levels with `size` entries along `dim`."""
    per_word = levels_per_word(bits)
    w = _to_uint(words.movedim(dim, -1))  # [..., num_words]
    shifts = bits * torch.arange(per_word, device=w.device)
    levels = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., num_words, per_word]
    return levels.flatten(-2)[..., :size].to(torch.int32).movedim(-1, dim).contiguous()


def pack_bitstream(levels: Tensor, bits: int, dim: int) -> Tensor:
    """Pack levels along `dim` as one little-endian bit stream; `size * bits` must fill whole words."""
    x = levels.to(torch.int64).movedim(dim, -1)  # [..., size]
    if (x.shape[-1] * bits) % _WORD_BITS:
        raise ValueError(f"{x.shape[-1]} levels of {bits} bits do not fill whole int32 words")
    bit_index = torch.arange(bits, device=x.device)
    stream = ((x.unsqueeze(-1) >> bit_index) & 1).flatten(-2)  # [..., size * bits]
    word_bits = stream.unflatten(-1, (-1, _WORD_BITS))  # [..., num_words, 32]
    words = (word_bits << torch.arange(_WORD_BITS, device=x.device)).sum(-1)
    return _to_int32(words).movedim(-1, dim).contiguous()


def unpack_bitstream(words: Tensor, bits: int, dim: int, size: int) -> Tensor:
    """Inverse of `pack_bitstream`."""
    w = _to_uint(words.movedim(dim, -1))  # [..., num_words]
    stream = ((w.unsqueeze(-1) >> torch.arange(_WORD_BITS, device=w.device)) & 1).flatten(-2)
    level_bits = stream[..., : size * bits].unflatten(-1, (size, bits))  # [..., size, bits]
    levels = (level_bits << torch.arange(bits, device=w.device)).sum(-1)
    return levels.to(torch.int32).movedim(-1, dim).contiguous()


def interleave_awq(levels: Tensor, dim: int) -> Tensor:
    """Reorder each run of 8 entries along `dim` into AutoAWQ's nibble order (before `pack_words`)."""
    x = levels.movedim(dim, -1).unflatten(-1, (-1, 8))
    return x[..., list(AWQ_ORDER)].flatten(-2).movedim(-1, dim)


def deinterleave_awq(levels: Tensor, dim: int) -> Tensor:
    """Inverse of `interleave_awq` (after `unpack_words`)."""
    inverse = sorted(range(8), key=AWQ_ORDER.__getitem__)  # [0, 4, 1, 5, 2, 6, 3, 7]
    x = levels.movedim(dim, -1).unflatten(-1, (-1, 8))
    return x[..., inverse].flatten(-2).movedim(-1, dim)
