"""Fused MoE (kernels/fused_moe*.py) against a float64 per-expert reference: experts that receive no
token, one token picking the same expert twice, ids of another rank's experts, FP8 weights, M = 1."""

import pytest
import torch
import torch.nn.functional as F

from llmc.kernels.fused_moe import align_by_expert, fused_moe_reference


def reference64(x, weights, ids, w1, w2, s1=None, s2=None):
    """out[t] = Σ_j weights[t, j] · down_e(silu(gate_e(x_t)) · up_e(x_t)), e = ids[t, j] in [0, E), in float64."""
    w1 = w1.double() * (1 if s1 is None else s1.double()[:, :, None])
    w2 = w2.double() * (1 if s2 is None else s2.double()[:, :, None])
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if 0 <= e < w1.shape[0]:
                gate, up = (w1[e] @ x[t].double()).chunk(2)
                out[t] += float(weights[t, j]) * (w2[e] @ (F.silu(gate) * up))
    return out


def _case(num_tokens, num_experts=4, top_k=2, hidden=48, inter=40, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(device, dtype)
    w1 = (0.2 * torch.randn(num_experts, 2 * inter, hidden, generator=gen)).to(device, dtype)
    w2 = (0.2 * torch.randn(num_experts, hidden, inter, generator=gen)).to(device, dtype)
    ids = torch.randint(0, num_experts - 1, (num_tokens, top_k), generator=gen).to(device)  # expert E-1: no token
    weights = torch.rand(num_tokens, top_k, generator=gen).to(device)
    return x, weights, ids, w1, w2


def test_alignment_lists_every_pair_once_in_its_experts_padded_run():
    ids = torch.tensor([[2, 0], [2, 2], [5, 1], [0, 2]])  # expert 3: none; 5: another rank's; token 1 twice to 2
    pairs, block_expert = align_by_expert(ids, 4, block_m=4)
    flat = ids.flatten()
    for b, e in enumerate(block_expert.tolist()):
        run = [p for p in pairs[b * 4:(b + 1) * 4].tolist() if p < flat.numel()]
        assert all(flat[p] == e for p in run)
    assert sorted(p for p in pairs.tolist() if p < flat.numel()) == [p for p in range(8) if flat[p] < 4]
    assert block_expert.tolist()[:3] == [0, 1, 2] and set(block_expert.tolist()[3:]) == {4}  # 2, 1, 4 pairs: a block each


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_fused_moe_matches_float64(num_tokens, dot_case, rel_err):
    from llmc.kernels import fused_moe_triton

    device, dtype = dot_case
    x, weights, ids, w1, w2 = _case(num_tokens, dtype=dtype, device=device)
    ids[0, 1] = ids[0, 0]  # top-k with a repeated expert: both copies count
    if num_tokens > 1:
        ids[1, 0] = 7  # an expert of another rank: contributes nothing here
    want = reference64(x.cpu(), weights.cpu(), ids.cpu(), w1.cpu(), w2.cpu())
    got = fused_moe_triton.fused_moe(x, weights, ids, w1, w2)
    # bf16 output and intermediate roundings alone are ~3e-3 (seen on an H100); fp16 ~8x finer
    tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert rel_err(got.cpu(), want) < tolerance
    assert rel_err(fused_moe_reference(x, weights, ids, w1, w2).cpu(), want) < tolerance


def test_fused_moe_fp8_weights_match_float64(device, rel_err):
    from llmc.kernels import fused_moe_triton

    dtype = torch.float16
    x, weights, ids, w1, w2 = _case(9, dtype=torch.float32, device=device)
    s1, s2 = w1.abs().amax(dim=2) / 448, w2.abs().amax(dim=2) / 448  # [E, 2I], [E, H]
    q1 = (w1 / s1[:, :, None]).to(torch.float8_e4m3fn)
    q2 = (w2 / s2[:, :, None]).to(torch.float8_e4m3fn)
    want = reference64(x.cpu(), weights.cpu(), ids.cpu(), q1.cpu().float(), q2.cpu().float(), s1.cpu(), s2.cpu())
    got = fused_moe_triton.fused_moe(x.to(dtype), weights, ids, q1, q2, s1, s2)
    assert rel_err(got.cpu(), want) < 3e-3
