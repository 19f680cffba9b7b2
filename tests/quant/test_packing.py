"""Bit packing: round trips, and hand-built words in the published positions."""

import pytest
import torch

from llmc.quant.packing import (
    deinterleave_awq,
    interleave_awq,
    num_words,
    pack_bitstream,
    pack_words,
    unpack_bitstream,
    unpack_words,
)


def as_int32(value: int) -> int:
    return value - 2**32 if value >= 2**31 else value


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_pack_words_round_trips_with_padding(bits: int, dim: int) -> None:
    levels = torch.randint(0, 2**bits, (37, 29), dtype=torch.int32)  # neither dim a word multiple
    words = pack_words(levels, bits, dim)
    assert words.dtype == torch.int32
    assert words.shape[dim] == num_words(levels.shape[dim], bits)
    assert torch.equal(unpack_words(words, bits, dim, levels.shape[dim]), levels)


def test_pack_words_4bit_puts_level_k_at_nibble_k() -> None:
    levels = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]], dtype=torch.int32)
    assert pack_words(levels, 4, dim=1).item() == as_int32(0x87654321)


def test_pack_words_3bit_holds_ten_levels_and_leaves_top_bits_zero() -> None:
    levels = torch.full((1, 11), 7, dtype=torch.int32)
    words = pack_words(levels, 3, dim=1)
    assert words.tolist() == [[2**30 - 1, 7]]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_bitstream_round_trips(bits: int) -> None:
    levels = torch.randint(0, 2**bits, (64, 5), dtype=torch.int32)
    words = pack_bitstream(levels, bits, dim=0)
    assert words.shape == (64 * bits // 32, 5)
    assert torch.equal(unpack_bitstream(words, bits, 0, 64), levels)


def test_bitstream_equals_per_word_when_bits_divide_32() -> None:
    levels = torch.randint(0, 16, (3, 64), dtype=torch.int32)
    assert torch.equal(pack_bitstream(levels, 4, dim=1), pack_words(levels, 4, dim=1))


def test_bitstream_3bit_levels_straddle_words_like_autogptq() -> None:
    # 32 levels in 3 words: level 10 spans bits 30..32, level 21 spans bits 63..65.
    levels = torch.zeros(32, dtype=torch.int32)
    levels[10] = 0b101
    levels[21] = 0b011
    words = pack_bitstream(levels.unsqueeze(1), 3, dim=0).squeeze(1).tolist()
    assert words == [1 << 30, 1 | as_int32(1 << 31), 1]


def test_awq_interleave_puts_output_order_0_2_4_6_1_3_5_7_in_nibbles() -> None:
    levels = torch.arange(8, dtype=torch.int32).unsqueeze(0)  # output o has level o
    word = pack_words(interleave_awq(levels, dim=1), 4, dim=1).item()
    assert word == 0x75316420
    assert torch.equal(deinterleave_awq(interleave_awq(levels, 1), 1), levels)
