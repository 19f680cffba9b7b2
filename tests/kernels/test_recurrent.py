"""The state layers' Triton kernels (kernels/recurrent_triton.py) against the layers' torch forms in float64, over a
step of sequences of different lengths (one-token decodes among them), some starting fresh, some continuing from their
slots' states, the slots out of order and one slot left untouched: the outputs, and every slot's state after the
step."""

import pytest
import torch

from llmc.kernels import recurrent
from llmc.runtime.models.gated_deltanet import l2_normalize, recurrent_delta_rule
from llmc.runtime.models.mamba2 import causal_conv, ssd_step

LENGTHS = [1, 7, 1, 19, 33]  # a step's pieces, in row order (the conv also a decode step's and a short one's)
FRESH = [False, True, True, False, False]
SLOTS = [4, 0, 2, 5, 1]  # slot 3 belongs to no sequence of the step


def _steps(device, lengths=LENGTHS):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return recurrent.StateSteps(cu, torch.tensor(SLOTS, device=device), torch.tensor(FRESH, device=device),
                                max(lengths))


def _pieces(lengths=LENGTHS):
    start = 0
    for i, length in enumerate(lengths):
        yield i, slice(start, start + length)
        start += length


@pytest.mark.parametrize("kernel, silu, bias, lengths", [(4, True, False, LENGTHS), (4, False, True, LENGTHS),
                                                         (3, False, False, LENGTHS), (4, True, True, [1] * 5),
                                                         (4, False, False, [2, 1, 9, 1, 16])])
def test_the_causal_conv_is_the_torch_conv(elementwise_case, kernel, silu, bias, lengths):
    """Pieces longer than a token block (a second launch writes the states), a decode step's and short pieces (one
    launch)."""
    device, dtype = elementwise_case
    torch.manual_seed(0)
    channels, total = 40, sum(lengths)
    x = torch.randn(total, channels, device=device).to(dtype)
    weight = torch.randn(channels, kernel, device=device).to(dtype)
    b = torch.randn(channels, device=device).to(dtype) if bias else None
    state = torch.randn(6, channels, kernel - 1, device=device).to(dtype)
    before = state.clone()
    out = recurrent.causal_conv(x, weight, b, state, _steps(device, lengths), silu, torch.float32)
    for i, rows in _pieces(lengths):
        start = torch.zeros_like(before[0]) if FRESH[i] else before[SLOTS[i]]
        expected, new = causal_conv(x[rows].double(), weight.double(), None if b is None else b.double(),
                                    start.double(), silu)
        torch.testing.assert_close(out[rows].double(), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state[SLOTS[i]].double(), new.to(dtype).double(), atol=0, rtol=0)
    torch.testing.assert_close(state[3], before[3], atol=0, rtol=0)


@pytest.mark.parametrize("group, key_dim, value_dim, lengths", [(2, 16, 16, LENGTHS), (1, 32, 48, LENGTHS),
                                                               (1, 32, 80, [1] * 5)])
def test_the_delta_rule_is_the_recurrent_torch_form(elementwise_case, group, key_dim, value_dim, lengths):
    """Prefill pieces and a decode step (each with its own tiles: kernels/recurrent.DELTA_RULE_TILES)."""
    device, dtype = elementwise_case
    torch.manual_seed(1)
    key_heads, total = 2, sum(lengths)
    heads = key_heads * group
    q, k = (torch.randn(total, key_heads * key_dim, device=device).to(dtype) for _ in range(2))
    v = torch.randn(total, heads * value_dim, device=device).to(dtype)
    g = -torch.rand(total, heads, device=device) * 0.5
    beta = torch.rand(total, heads, device=device)
    state = torch.randn(6, heads, key_dim, value_dim, device=device) * 0.3
    before = state.clone()
    scale = key_dim ** -0.5
    out = recurrent.delta_rule(q, k, v, g, beta, state, _steps(device, lengths), scale, 1e-6)
    for i, rows in _pieces(lengths):
        qs, ks = (l2_normalize(t[rows].double().unflatten(-1, (key_heads, key_dim))).repeat_interleave(group, 1)
                  for t in (q, k))
        start = torch.zeros_like(before[0]) if FRESH[i] else before[SLOTS[i]]
        expected, new = recurrent_delta_rule((qs * scale)[None], ks[None], v[rows].double().unflatten(-1, (heads, -1))[None],
                                             g[rows].double()[None], beta[rows].double()[None], start.double()[None])
        torch.testing.assert_close(out[rows].double(), expected[0].flatten(1), atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(state[SLOTS[i]].double(), new[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(state[3], before[3], atol=0, rtol=0)


@pytest.mark.parametrize("groups, head_dim, d_state, lengths", [(2, 8, 16, LENGTHS), (1, 12, 32, LENGTHS),
                                                               (2, 40, 16, [1] * 5)])
def test_the_ssd_recurrence_is_the_torch_step(elementwise_case, groups, head_dim, d_state, lengths):
    """Prefill pieces and a decode step (each with its own tiles: kernels/recurrent.SSD_TILES)."""
    device, dtype = elementwise_case
    torch.manual_seed(2)
    heads, total = 4, sum(lengths)
    x = torch.randn(total, heads * head_dim, device=device).to(dtype)
    b, c = (torch.randn(total, groups * d_state, device=device).to(dtype) for _ in range(2))
    dt = torch.rand(total, heads, device=device) * 0.5
    a, d = -torch.rand(heads, device=device) * 2, torch.randn(heads, device=device)
    state = torch.randn(6, heads, head_dim, d_state, device=device) * 0.3
    before = state.clone()
    out = recurrent.ssd(x, dt, a, b, c, d, state, _steps(device, lengths))
    for i, rows in _pieces(lengths):
        s = torch.zeros_like(before[0]).double() if FRESH[i] else before[SLOTS[i]].double()
        for t in range(rows.start, rows.stop):
            y = ssd_step(x[t].double().unflatten(-1, (heads, head_dim)), dt[t].double(), a.double(),
                         b[t].double().unflatten(-1, (groups, d_state)), c[t].double().unflatten(-1, (groups, d_state)),
                         d.double(), s)
            torch.testing.assert_close(out[t].double(), y.flatten(), atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(state[SLOTS[i]].double(), s, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(state[3], before[3], atol=0, rtol=0)
