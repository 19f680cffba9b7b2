"""Shared fixtures for the quantization tests: random plain-form weights of any integer setting."""

import pytest
import torch

from llmc.quant.formats import QuantizedWeight, num_groups_of


def random_quantized_weight(
    bits: int,
    group_size: int,
    symmetric: bool,
    out_features: int = 24,
    in_features: int = 128,
    is_act_order: bool = False,
    seed: int = 0,
) -> QuantizedWeight:
    generator = torch.Generator().manual_seed(seed)
    num_groups = num_groups_of(in_features, group_size)
    levels = torch.randint(0, 2**bits, (out_features, in_features), generator=generator, dtype=torch.int32)
    scales = torch.rand(out_features, num_groups, generator=generator) * 0.1 + 0.01
    zeros = (
        None
        if symmetric
        else torch.randint(0, 2**bits, (out_features, num_groups), generator=generator, dtype=torch.int32)
    )
    g_idx = None
    if is_act_order:  # every group keeps group_size columns, scattered over the input dim
        g_idx = (torch.randperm(in_features, generator=generator) // group_size).to(torch.int32)
    return QuantizedWeight(levels, scales, zeros, bits, group_size, g_idx)


@pytest.fixture
def make_qweight():
    return random_quantized_weight
