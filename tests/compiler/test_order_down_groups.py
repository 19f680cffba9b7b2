"""The build puts an act-order down projection's groups in order and gate_up's rows alike
(compiler/shard.order_down_groups): the MLP computes the same function, in float64 from the
published int formula w = (q - z) · s[g_idx], and down is left without g_idx."""

from __future__ import annotations

import torch

from llmc.compiler.convert import LayerWeights
from llmc.compiler.shard import order_down_groups
from llmc.quant.formats import QuantizedWeight


def _dequantize(q: QuantizedWeight) -> torch.Tensor:
    groups = q.g_idx.long() if q.g_idx is not None else torch.arange(q.in_features) // q.group_size
    zeros = q.zeros.double() if q.zeros is not None else torch.full_like(q.scales.double(), 2 ** (q.bits - 1))
    return (q.qweight.double() - zeros[:, groups]) * q.scales.double()[:, groups]


def _random_int(out_features: int, in_features: int, group_size: int, act_order: bool, seed: int) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    num_groups = in_features // group_size
    g_idx = None
    if act_order:
        g_idx = torch.empty(in_features, dtype=torch.int32)
        g_idx[torch.randperm(in_features, generator=g)] = torch.arange(in_features, dtype=torch.int32) // group_size
    return QuantizedWeight(torch.randint(0, 16, (out_features, in_features), generator=g, dtype=torch.int32),
                           torch.rand(out_features, num_groups, generator=g) * 0.1 + 0.01,
                           torch.randint(0, 16, (out_features, num_groups), generator=g, dtype=torch.int32),
                           4, group_size, g_idx)


def _mlp(layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
    gate_up = layer.linears["mlp.gate_up"]
    w = _dequantize(gate_up) if isinstance(gate_up, QuantizedWeight) else gate_up.double()
    h = x @ w.T + layer.biases.get("mlp.gate_up", torch.zeros(w.shape[0])).double()
    gate, up = h.chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up) @ _dequantize(layer.linears["mlp.down"]).T


def test_the_mlp_is_unchanged_and_down_loses_its_g_idx():
    hidden, inter, group = 48, 96, 16
    x = torch.randn(5, hidden, dtype=torch.float64)
    for gate_up in (_random_int(2 * inter, hidden, group, True, 1),  # act order on gate_up too
                    torch.randn(2 * inter, hidden)):  # or left dense
        down = _random_int(hidden, inter, group, True, 2)
        layer = LayerWeights(0, {"mlp.gate_up": gate_up, "mlp.down": down},
                             {"mlp.gate_up": torch.randn(2 * inter)}, {})
        ordered = order_down_groups(layer)
        assert ordered.linears["mlp.down"].g_idx is None
        torch.testing.assert_close(_mlp(ordered, x), _mlp(layer, x), rtol=1e-12, atol=1e-12)
        if isinstance(gate_up, QuantizedWeight):  # gate_up's own input order is untouched
            assert torch.equal(ordered.linears["mlp.gate_up"].g_idx, gate_up.g_idx)


def test_down_in_order_or_with_unequal_groups_is_left_as_it_is():
    gate_up = torch.randn(64, 16)
    plain = _random_int(16, 32, 8, False, 3)
    unequal = _random_int(16, 32, 8, True, 4)
    unequal.g_idx[unequal.g_idx == 1] = 0  # group 0 twice the size of the others
    for down in (plain, unequal):
        layer = LayerWeights(0, {"mlp.gate_up": gate_up, "mlp.down": down}, {}, {})
        ordered = order_down_groups(layer)
        assert ordered.linears["mlp.down"] is down and ordered.linears["mlp.gate_up"] is gate_up
