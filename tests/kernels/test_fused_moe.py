"""Fused MoE (kernels/fused_moe*.py) against a float64 per-expert reference: experts that receive no
token, one token picking the same expert twice, ids of another rank's experts, M = 1; dense,
weight-only FP8, W4A16 (gpu layout, packed by the format, reference weights dequantized by
quant/reference.py) and W8A8-FP8 experts (reference: the format's activation quantization from
quant/numerics.py, then float64), the last two built through the runtime's ExpertLinears →
ExpertWeights mapping (runtime/models/moe.py:expert_weights)."""

import pytest
import torch
import torch.nn.functional as F

import dataclasses

from llmc.kernels.fused_moe import MOE_CONFIGS, ExpertWeights, MoeConfig, align_by_expert, fused_moe_reference


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
    got = fused_moe_triton.fused_moe(x, weights, ids, ExpertWeights(w1), ExpertWeights(w2))
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
    got = fused_moe_triton.fused_moe(x.to(dtype), weights, ids, ExpertWeights(q1, "fp8", s1), ExpertWeights(q2, "fp8", s2))
    assert rel_err(got.cpu(), want) < 3e-3



def _packed_experts(fmt, quantized, in_features, out_features):
    """The runtime's ExpertLinears holding `quantized` (one QuantizedWeight per expert) packed in
    fmt, and the kernel's view of it (runtime/models/moe.py:expert_weights)."""
    from llmc.runtime.models.moe import ExpertLinears, expert_weights

    linears = ExpertLinears(len(quantized), in_features, out_features, fmt)
    packed = [fmt.pack(q) for q in quantized]
    for name in linears.param_names:
        setattr(linears, name, torch.stack([p[name] for p in packed]))
    return expert_weights(linears)


def _w4a16_experts(num_experts, out_features, in_features, group_size, symmetric, dtype, gen):
    """Random levels, scales and zeros per expert → (the kernel's stacked gpu-layout ExpertWeights,
    the float32 weights [E, out, in] dequantized by quant/reference.py from the plain form)."""
    from llmc.quant.formats import IntWeightFormat, QuantizedWeight
    from llmc.quant.reference import dequantize_weight

    fmt = IntWeightFormat(dtype, bits=4, group_size=group_size, symmetric=symmetric, layout="gpu")
    groups = 1 if group_size == -1 else in_features // group_size
    quantized = []
    for _ in range(num_experts):
        levels = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.int32)
        scales = (0.01 + 0.02 * torch.rand(out_features, groups, generator=gen)).to(dtype).float()  # model dtype
        zeros = None if symmetric else torch.randint(0, 16, (out_features, groups), generator=gen, dtype=torch.int32)
        quantized.append(QuantizedWeight(levels, scales, zeros, bits=4, group_size=group_size))
    weights = _packed_experts(fmt, quantized, in_features, out_features)
    assert weights.kind == "w4a16"
    return weights, torch.stack([dequantize_weight(q) for q in quantized])


def _on(w, device):
    """ExpertWeights with its tensors moved to device."""
    moved = {name: getattr(w, name).to(device) for name in ("weight", "scale", "zeros", "input_scale")
             if getattr(w, name) is not None}
    return dataclasses.replace(w, **moved)


def _route(num_tokens, num_experts, top_k, gen):
    """Ids in [0, E - 1) (expert E - 1 gets no token), a repeated expert, and other ranks' ids."""
    ids = torch.randint(0, num_experts - 1, (num_tokens, top_k), generator=gen)
    ids[0, 1] = ids[0, 0]  # top-k with a repeated expert: both copies count
    if num_tokens > 2:
        ids[1, 0], ids[2, 1] = num_experts + 3, -1  # experts of other ranks (after and before this one's)
    return torch.rand(num_tokens, top_k, generator=gen), ids


# (hidden, intermediate, group size, symmetric): K below one 128-column tile (padded) and above
W4_SHAPES = [(64, 32, 32, True), (64, 96, 32, False), (64, 64, -1, False), (128, 128, 128, True), (128, 64, 64, False)]


@pytest.mark.parametrize("hidden,inter,group_size,symmetric", W4_SHAPES)
@pytest.mark.parametrize("num_tokens", [1, 9])
def test_fused_moe_w4a16_matches_float64_of_dequantized_weights(hidden, inter, group_size, symmetric, num_tokens,
                                                                dot_case, rel_err):
    from llmc.kernels import fused_moe_triton

    device, dtype = dot_case
    gen = torch.Generator().manual_seed(num_tokens + hidden + inter)
    num_experts = 4
    gate_up, w1 = _w4a16_experts(num_experts, 2 * inter, hidden, group_size, symmetric, dtype, gen)
    down, w2 = _w4a16_experts(num_experts, hidden, inter, group_size, symmetric, dtype, gen)
    x = torch.randn(num_tokens, hidden, generator=gen)
    weights, ids = _route(num_tokens, num_experts, 2, gen)
    want = reference64(x, weights, ids, w1, w2)
    gate_up, down = _on(gate_up, device), _on(down, device)
    got = fused_moe_triton.fused_moe(x.to(device, dtype), weights.to(device), ids.to(device), gate_up, down)
    tolerance = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}[dtype]
    assert rel_err(got.cpu(), want) < tolerance


def _fp8_experts(num_experts, out_features, in_features, per_channel, static, gen):
    """Random FP8 experts in the w8a8-fp8 format → (the kernel's ExpertWeights, the weights
    [E, out, in] float32, the static input scales [E] or None)."""
    from llmc.quant.formats import Fp8Format, QuantizedWeight

    fmt = Fp8Format(torch.float32, is_per_channel=per_channel, is_static_input=static)
    quantized = []
    for _ in range(num_experts):
        weight = (torch.randn(out_features, in_features, generator=gen) * 8).to(torch.float8_e4m3fn)
        scale = 0.01 + 0.02 * torch.rand(out_features if per_channel else 1, 1, generator=gen)
        input_scale = (0.5 + torch.rand(1, generator=gen)) / 100 if static else None
        quantized.append(QuantizedWeight(weight, scale, None, bits=8, group_size=-1, input_scale=input_scale))
    weights = _packed_experts(fmt, quantized, in_features, out_features)
    assert weights.kind == "w8a8-fp8"
    dense = torch.stack([q.qweight.float() * q.scales for q in quantized])
    return weights, dense, torch.cat([q.input_scale for q in quantized]) if static else None


def reference64_w8a8(x, weights, ids, w1, w2, in1, in2):
    """As reference64, with each expert's inputs quantized as the w8a8-fp8 format does (quant/numerics:
    per token, or the expert's static scale) before the float64 product; the down input is the
    gate_up result rounded to x's dtype, as the model computes it."""
    from llmc.quant.numerics import quantize_fp8_per_token, quantize_fp8_static

    def quantized(rows, input_scale):
        q, scale = quantize_fp8_per_token(rows) if input_scale is None else quantize_fp8_static(rows, input_scale)
        return q.double() * scale.double()

    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if 0 <= e < w1.shape[0]:
                h = (quantized(x[t:t + 1], None if in1 is None else in1[e]) @ w1[e].double().T).to(x.dtype)
                gate, up = h.double().chunk(2, dim=-1)
                act = (F.silu(gate) * up).to(x.dtype)
                out[t] += float(weights[t, j]) * (quantized(act, None if in2 is None else in2[e]) @ w2[e].double().T)[0]
    return out


@pytest.mark.parametrize("per_channel,static", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("num_tokens", [1, 9])
def test_fused_moe_w8a8_fp8_matches_the_formats_math_in_float64(per_channel, static, num_tokens, device, rel_err):
    from llmc.kernels import fused_moe_triton

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    gen = torch.Generator().manual_seed(num_tokens + 10 * static + 20 * per_channel)
    num_experts, hidden, inter = 4, 64, 48
    gate_up, w1, in1 = _fp8_experts(num_experts, 2 * inter, hidden, per_channel, static, gen)
    down, w2, in2 = _fp8_experts(num_experts, hidden, inter, per_channel, static, gen)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    weights, ids = _route(num_tokens, num_experts, 2, gen)
    want = reference64_w8a8(x, weights, ids, w1, w2, in1, in2)
    got = fused_moe_triton.fused_moe(x.to(device), weights.to(device), ids.to(device), _on(gate_up, device), _on(down, device))
    # float32: the same FP8 inputs, exact products (one FP8 rounding flip would show as ~1e-3);
    # bf16 on the GPU: the gate_up and output roundings
    assert rel_err(got.cpu(), want) < (1e-5 if dtype == torch.float32 else 1.5e-2)


def _fp8_block_experts(num_experts, out_features, in_features, columns, gen):
    """Random experts in the w8a8-fp8-block format (blocks of 128 rows x `columns`) → (the kernel's ExpertWeights,
    the weights [E, out, in] float32 as the definition dequantizes them: levels times their block's scale)."""
    from llmc.quant.formats import make_format
    from llmc.quant.fp8 import quantize_fp8_weight_block

    fmt = make_format({"format": "w8a8-fp8-block", "block_size": [128, columns]}, torch.float32)
    w = torch.randn(num_experts, out_features, in_features, generator=gen) * torch.logspace(-1, 0.5, in_features)
    quantized = [quantize_fp8_weight_block(w[e], (128, columns)) for e in range(num_experts)]
    weights = _packed_experts(fmt, quantized, in_features, out_features)
    assert weights.kind == "w8a8-fp8-block" and weights.scale.shape == (num_experts, out_features, -(-in_features // columns))
    dense = torch.stack([q.qweight.float() * q.scales.repeat_interleave(columns, dim=1)[:, :in_features] for q in quantized])
    return weights, dense


def reference64_w8a8_block(x, weights, ids, w1, w2, columns):
    """As reference64_w8a8, each expert's input rows quantized per token and `columns` inputs by the scheme's
    definition (scale = absmax / 448 of the group in float64, values rounded to E4M3), the last group partial."""

    def quantized(rows):
        out = torch.empty(rows.shape, dtype=torch.float64)
        for c in range(0, rows.shape[-1], columns):
            group = rows[..., c:c + columns].double()
            scale = group.abs().amax(dim=-1, keepdim=True) / 448.0
            out[..., c:c + columns] = (group / scale).float().to(torch.float8_e4m3fn).double() * scale
        return out

    result = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if 0 <= e < w1.shape[0]:
                h = (quantized(x[t:t + 1]) @ w1[e].double().T).to(x.dtype)
                gate, up = h.double().chunk(2, dim=-1)
                act = (F.silu(gate) * up).to(x.dtype)
                result[t] += float(weights[t, j]) * (quantized(act) @ w2[e].double().T)[0]
    return result


@pytest.mark.parametrize("hidden, inter, columns", [(256, 192, 128), (96, 80, 32)])  # last groups partial
@pytest.mark.parametrize("num_tokens", [1, 9, 40])
def test_fused_moe_w8a8_fp8_block_matches_the_formats_math_in_float64(hidden, inter, columns, num_tokens, device,
                                                                       rel_err):
    """Block-scaled FP8 experts (DeepSeek-V3's, Qwen3-MoE's FP8 checkpoints): each group's FP8 product scaled by its
    row's and channel's scales; 1 and 9 tokens take MOE_CONFIGS["w8a8-fp8-block"]'s first entry, 40 tokens its second."""
    from llmc.kernels import fused_moe_triton

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    gen = torch.Generator().manual_seed(num_tokens + columns)
    gate_up, w1 = _fp8_block_experts(4, 2 * inter, hidden, columns, gen)
    down, w2 = _fp8_block_experts(4, hidden, inter, columns, gen)
    x = (torch.randn(num_tokens, hidden, generator=gen) * torch.logspace(0.5, -1, hidden)).to(dtype)
    weights, ids = _route(num_tokens, 4, 2, gen)
    want = reference64_w8a8_block(x, weights, ids, w1, w2, columns)
    got = fused_moe_triton.fused_moe(x.to(device), weights.to(device), ids.to(device), _on(gate_up, device), _on(down, device))
    # float32: the same FP8 inputs and exact products; bf16 on the GPU: the gate_up and output roundings, and the
    # down input's FP8 roundings they flip (32-column groups, 9 tokens: 2.1% on an H200, session 44's call 1)
    assert rel_err(got.cpu(), want) < (1e-5 if dtype == torch.float32 else 3e-2)


# every tile config of the measured table (all kinds'), 32-row tiles (so every block_m of align_by_expert) and 4
# packed tiles per step
_TILE_CONFIGS = (*sorted({config for entries in MOE_CONFIGS.values() for _, config in entries}, key=repr),
                 MoeConfig(block_m=32, block_n=64, num_stages=4), MoeConfig(block_m=16, block_n=32, w4_tiles=4))


def test_every_expert_kind_has_tiles_for_any_number_of_tokens():
    from llmc.kernels.fused_moe import KINDS, select_moe_config

    assert set(MOE_CONFIGS) == set(KINDS)
    for kind in KINDS:
        assert select_moe_config(10**9, 8, 1, kind) == MOE_CONFIGS[kind][-1][1]


@pytest.mark.parametrize("config", _TILE_CONFIGS, ids=repr)
def test_every_tile_config_of_the_table_computes_the_same_moe(config, rel_err):
    """Each of _TILE_CONFIGS on dense, W4A16 and W8A8-FP8 experts, in float32 (exact products in the interpreter),
    against the float64 references."""
    from llmc.kernels import fused_moe_triton

    gen = torch.Generator().manual_seed(config.block_m + config.block_n + config.w4_tiles)
    x = torch.randn(9, 128, generator=gen)
    weights, ids = _route(9, 4, 2, gen)
    w4_up, w1 = _w4a16_experts(4, 192, 128, 64, False, torch.float32, gen)
    w4_down, w2 = _w4a16_experts(4, 128, 96, 32, True, torch.float32, gen)
    got = fused_moe_triton.fused_moe(x, weights, ids, w4_up, w4_down, config)
    assert rel_err(got, reference64(x, weights, ids, w1, w2)) < 1e-5
    got = fused_moe_triton.fused_moe(x, weights, ids, ExpertWeights(w1), ExpertWeights(w2), config)
    assert rel_err(got, reference64(x, weights, ids, w1, w2)) < 1e-5
    f8_up, w1, _ = _fp8_experts(4, 192, 128, True, False, gen)
    f8_down, w2, _ = _fp8_experts(4, 128, 96, True, False, gen)
    got = fused_moe_triton.fused_moe(x, weights, ids, f8_up, f8_down, config)
    assert rel_err(got, reference64_w8a8(x, weights, ids, w1, w2, None, None)) < 1e-5


def _runtime_experts(kind, num_experts, out_features, in_features, device, gen):
    """ExpertLinears (the runtime's module) of one format holding random experts, on device."""
    from llmc.quant.formats import DenseFormat, Fp8BlockFormat, Fp8Format, IntWeightFormat, QuantizedWeight
    from llmc.quant.fp8 import quantize_fp8_weight_block
    from llmc.runtime.models.moe import ExpertLinears

    dtype = torch.bfloat16
    fmt = {"dense": DenseFormat(dtype), "w4a16-gpu": IntWeightFormat(dtype, layout="gpu"),
           "w4a16-plain": IntWeightFormat(dtype), "fp8-dynamic": Fp8Format(dtype, is_per_channel=False),
           "fp8-static": Fp8Format(dtype, is_static_input=True), "fp8-block": Fp8BlockFormat(dtype)}[kind]
    linears = ExpertLinears(num_experts, in_features, out_features, fmt)
    packed = []
    for _ in range(num_experts):
        w = 0.05 * torch.randn(out_features, in_features, generator=gen)
        if kind == "dense":
            packed.append(fmt.pack_dense(w))
        elif kind == "fp8-block":
            packed.append(fmt.pack(quantize_fp8_weight_block(w, (128, 128))))
        elif kind.startswith("w4a16"):
            scales = w.abs().unflatten(1, (-1, 128)).amax(dim=2) / 7  # [out, G]
            levels = (w / scales.repeat_interleave(128, dim=1) + 8).round().clamp(0, 15).to(torch.int32)
            packed.append(fmt.pack(QuantizedWeight(levels, scales, None, bits=4, group_size=128)))
        else:
            scale = w.abs().amax().reshape(1, 1) / 448
            packed.append(fmt.pack(QuantizedWeight((w / scale).to(torch.float8_e4m3fn), scale, None, bits=8, group_size=-1,
                                                   input_scale=torch.tensor([0.01]))))
    for name in linears.param_names:
        setattr(linears, name, torch.stack([p[name] for p in packed]).to(device))
    return linears


@pytest.mark.parametrize("kind", ["dense", "w4a16-gpu", "w4a16-plain", "fp8-dynamic", "fp8-static", "fp8-block"])
def test_runtime_moe_takes_the_fused_kernel_on_cuda_where_the_format_allows(kind, device, rel_err):
    """runtime/models/moe.py: on CUDA, dense, gpu-layout w4a16 and w8a8-fp8 experts run the fused
    kernel and agree with the expert-by-expert path through the formats' own kernels; plain-layout
    experts, and every format on a CPU, take the per-expert path (None)."""
    from llmc.kernels.fused_moe import fused_moe_experts
    from llmc.runtime.models.moe import expert_weights, fused_expert_weights

    gen = torch.Generator().manual_seed(0)
    gate_up = _runtime_experts(kind, 4, 256, 128, device, gen)
    down = _runtime_experts(kind, 4, 128, 128, device, gen)
    view = expert_weights(gate_up)
    assert (view and view.kind) == {"dense": "dense", "w4a16-gpu": "w4a16", "w4a16-plain": None,
                                    "fp8-block": "w8a8-fp8-block"}.get(kind, "w8a8-fp8")
    if kind in ("fp8-dynamic", "fp8-static"):  # per-tensor weight scales reach the kernel per channel; static input scales per expert
        assert torch.equal(view.scale, gate_up.weight_scale.reshape(4, -1).expand(4, 256))
        assert (view.input_scale is None) == (kind == "fp8-dynamic")
    x = torch.randn(5, 128, generator=gen).to(device, torch.bfloat16)
    weights, ids = _route(5, 4, 2, gen)
    weights, ids = weights.to(device), ids.to(device)
    fused = fused_expert_weights(x, gate_up, down)
    if device == "cpu" or kind == "w4a16-plain":
        assert fused is None
        return
    got = fused_moe_experts(x, weights, ids, *fused)
    want = torch.zeros_like(x)
    for e in range(4):
        token, slot = torch.where(ids == e)
        h = gate_up.apply_expert(e, x[token])
        y = down.apply_expert(e, F.silu(h[:, :128]) * h[:, 128:])
        want.index_add_(0, token, y * weights[token, slot, None].to(y.dtype))
    assert rel_err(got.float().cpu(), want.float().cpu()) < 2e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind", ["dense", "w4a16-gpu", "fp8-dynamic", "fp8-static", "fp8-block", "w4a16-plain"])
def test_runtime_moe_captures_in_a_cuda_graph_and_replays_new_routes(kind):
    """Decode steps capture the MoE in CUDA graphs: capturing it must not copy from the host, and a
    replay with new inputs and new routes (written into the captured buffers) equals eager."""
    from llmc.runtime.models.moe import MoE

    gen = torch.Generator().manual_seed(1)
    gate_up = _runtime_experts(kind, 4, 256, 128, "cuda", gen)
    down = _runtime_experts(kind, 4, 128, 128, "cuda", gen)
    moe = MoE.__new__(MoE)
    torch.nn.Module.__init__(moe)
    moe.top_k, moe.norm_topk_prob, moe.expert_start, moe.num_local_experts = 2, True, 0, 4
    moe.gate = torch.nn.Module()
    moe.gate.register_buffer("weight", (0.5 * torch.randn(4, 128, generator=gen)).to("cuda", torch.bfloat16))
    moe.experts = torch.nn.Module()
    moe.experts.gate_up, moe.experts.down = gate_up, down
    moe.tp_group, moe.observers, moe.has_shared, moe.is_deepseek_router = None, [], False, False
    moe.has_bias, moe.swiglu, moe.scoring = False, None, "softmax"
    x = torch.randn(6, 128, generator=gen).to("cuda", torch.bfloat16)
    moe(x)  # compile the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(x)
    for seed in range(3):
        x.copy_(torch.randn(6, 128, generator=torch.Generator().manual_seed(10 + seed)).to("cuda", torch.bfloat16))
        graph.replay()
        assert torch.equal(out, moe(x))


# ---- gpt-oss: biased experts and the clamped SwiGLU ---------------------------------------------------------------

SWIGLU = (1.702, 1.0)  # gpt-oss's alpha; a limit of 1 binds on many of these gate / up outputs (std ~1.4)


def gpt_oss_experts64(x, weights, ids, w1, b1, w2, b2):
    """transformers' own GptOssExperts in float64 holding these experts (w1 [E, 2I, H] gate rows then up, w2 [E, H, I],
    biases [E, 2I] and [E, H]): gate_up_proj [E, H, 2I] with gate and up interleaved in its columns, down_proj
    [E, I, H], input-major as transformers stores them."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    num_experts, two_i, hidden = w1.shape
    config = GptOssConfig(hidden_size=hidden, intermediate_size=two_i // 2, num_local_experts=num_experts,
                          swiglu_alpha=SWIGLU[0], swiglu_limit=SWIGLU[1])
    experts = GptOssExperts(config).double()
    experts.alpha, experts.limit = SWIGLU  # (transformers before ~5.18 hard-coded 1.702 and 7.0: tests.conftest)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.stack(w1.double().chunk(2, dim=1), dim=2).flatten(1, 2).transpose(1, 2))
        experts.gate_up_proj_bias.copy_(torch.stack(b1.double().chunk(2, dim=1), dim=2).flatten(1))
        experts.down_proj.copy_(w2.double().transpose(1, 2))
        experts.down_proj_bias.copy_(b2.double())
        return experts(x.double(), ids, weights.double())


def _gpt_oss_route(num_tokens, num_experts, gen):
    ids = torch.randint(0, num_experts - 1, (num_tokens, 2), generator=gen)  # expert E - 1: no token
    ids[0, 1] = ids[0, 0]  # a repeated expert: both copies count
    return torch.rand(num_tokens, 2, generator=gen), ids


@pytest.mark.parametrize("num_tokens", [1, 9])
def test_fused_moe_with_biases_and_clamped_swiglu_is_transformers_gpt_oss_experts(num_tokens, dot_case, rel_err):
    """Dense and W4A16 (gpu layout) experts with biases and gpt-oss's clamped SwiGLU through the Triton kernels, and
    dense through the torch reference: transformers' GptOssExperts in float64 on the same (dequantized) weights; the
    biases and the clamps matter."""
    from llmc.kernels import fused_moe_triton

    device, dtype = dot_case
    gen = torch.Generator().manual_seed(num_tokens)
    x, _, _, w1, w2 = _case(num_tokens)
    b1, b2 = 0.5 * torch.randn(4, w1.shape[1], generator=gen), 0.5 * torch.randn(4, w2.shape[1], generator=gen)
    weights, ids = _gpt_oss_route(num_tokens, 4, gen)
    want = gpt_oss_experts64(x, weights, ids, w1, b1, w2, b2)
    tolerance = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]  # (bf16: on a GPU only)
    on = lambda t: t.to(device, dtype)  # noqa: E731
    gate_up, down = ExpertWeights(on(w1), bias=on(b1)), ExpertWeights(on(w2), bias=on(b2))
    got = fused_moe_triton.fused_moe(on(x), weights.to(device), ids.to(device), gate_up, down, swiglu=SWIGLU)
    assert rel_err(got.cpu(), want) < tolerance
    assert rel_err(fused_moe_reference(x, weights, ids, ExpertWeights(w1, bias=b1), ExpertWeights(w2, bias=b2),
                                       swiglu=SWIGLU), want) < 1e-5
    assert rel_err(reference64(x, weights, ids, w1, w2), want) > 0.1  # without biases and clamps: far off
    q_up, w1 = _w4a16_experts(4, 64, 64, 32, False, dtype, gen)
    q_down, w2 = _w4a16_experts(4, 64, 32, 32, True, dtype, gen)
    x = torch.randn(num_tokens, 64, generator=gen)
    b1, b2 = 0.5 * torch.randn(4, 64, generator=gen), 0.5 * torch.randn(4, 64, generator=gen)
    want = gpt_oss_experts64(x, weights, ids, w1, b1, w2, b2)
    q_up, q_down = dataclasses.replace(_on(q_up, device), bias=on(b1)), dataclasses.replace(_on(q_down, device), bias=on(b2))
    got = fused_moe_triton.fused_moe(on(x), weights.to(device), ids.to(device), q_up, q_down, swiglu=SWIGLU)
    assert rel_err(got.cpu(), want) < tolerance


# ---- Nemotron-H: experts without gate, relu(up)² --------------------------------------------------------------------

def nemotron_h_experts64(x, weights, ids, up, down):
    """transformers' own NemotronHExperts (relu2, no gate) in float64 holding these experts (up [E, I, H], down
    [E, H, I]) on the same routes."""
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    num_experts, inter, hidden = up.shape
    config = NemotronHConfig(hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=num_experts)
    config._experts_implementation = "eager"
    experts = NemotronHExperts(config).double()
    with torch.no_grad():
        experts.up_proj.copy_(up.double())
        experts.down_proj.copy_(down.double())
        return experts(x.double(), ids, weights.double())


@pytest.mark.parametrize("num_tokens", [1, 9])
def test_fused_moe_relu2_experts_are_transformers_nemotron_h_experts(num_tokens, dot_case, rel_err):
    """Dense and W4A16 (gpu layout) experts without gate (gate_up: up's rows alone) and relu(up)² between the grouped
    GEMMs (relu2) through the Triton kernels, and dense through the torch reference: transformers' NemotronHExperts in
    float64 on the same (dequantized) weights; SiLU-gated on the same weights is far off."""
    from llmc.kernels import fused_moe_triton

    device, dtype = dot_case
    gen = torch.Generator().manual_seed(20 + num_tokens)
    x, _, _, up, down = _case(num_tokens, inter=40)
    up = up[:, :40]  # [E, I, H]
    weights, ids = _gpt_oss_route(num_tokens, 4, gen)
    want = nemotron_h_experts64(x, weights, ids, up, down)
    tolerance = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]  # (bf16: on a GPU only)
    on = lambda t: t.to(device, dtype)  # noqa: E731
    got = fused_moe_triton.fused_moe(on(x), weights.to(device), ids.to(device), ExpertWeights(on(up)),
                                     ExpertWeights(on(down)), relu2=True)
    assert rel_err(got.cpu(), want) < tolerance
    assert rel_err(fused_moe_reference(x, weights, ids, up, down, relu2=True), want) < 1e-5
    assert rel_err(fused_moe_reference(x, weights, ids, torch.cat([up, up], 1), down), want) > 0.1
    q_up, up = _w4a16_experts(4, 64, 64, 32, False, dtype, gen)
    q_down, down = _w4a16_experts(4, 64, 64, 32, True, dtype, gen)
    x = torch.randn(num_tokens, 64, generator=gen)
    want = nemotron_h_experts64(x, weights, ids, up, down)
    got = fused_moe_triton.fused_moe(on(x), weights.to(device), ids.to(device), _on(q_up, device), _on(q_down, device),
                                     relu2=True)
    assert rel_err(got.cpu(), want) < tolerance


_COMPILE_SM90_BIAS = r"""
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llmc.kernels import fused_moe_triton as ft

POINTERS = {"a_scale_ptr": "*fp32", "scale_ptr": "*fp32", "pairs_ptr": "*i32", "block_expert_ptr": "*i32",
            "topk_weights_ptr": "*fp32", "qw_ptr": "*i32", "qz_ptr": "*i32", "s_ptr": "*bf16"}


def compile_facts(kernel, constants, num_warps=4):
    sig = {n: "constexpr" if n in constants else POINTERS.get(n, "*bf16") if n.endswith("_ptr") else "i32"
           for n in kernel.arg_names}
    names = list(kernel.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*")}
    compiled = triton.compile(ASTSource(kernel, sig, constants, attrs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps})
    ptx = compiled.asm["ptx"]
    return {"mma": "mma.sync" in ptx or "wgmma" in ptx, "local": ".local" in ptx, "shared": compiled.metadata.shared}


facts = {}
try:
    for weight in (False, True):  # gate_up (no routing weight), down (with it)
        facts[f"dense-{weight}"] = compile_facts(ft._grouped_gemm_kernel, {
            "A_ROWS_PER_PAIR": 4 if not weight else 1, "HAS_SCALE": False, "HAS_A_SCALE": False, "GROUP": 0,
            "MUL_WEIGHT": weight, "PRECISION": "tf32", "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128,
            "HAS_BIAS": True})
        facts[f"w4a16-{weight}"] = compile_facts(ft._grouped_w4a16_kernel, {
            "A_ROWS_PER_PAIR": 4 if not weight else 1, "GROUP_SIZE": 32, "HAS_ZEROS": False, "MUL_WEIGHT": weight,
            "PRECISION": "tf32", "TILES": 1, "GROUPS": 4, "BLOCK_M": 16, "BLOCK_N": 64, "HAS_BIAS": True})
except FileNotFoundError as exc:  # a triton without its bundled ptxas
    print("SKIP", exc)
    raise SystemExit(0)
print(json.dumps(facts))
"""


def test_the_grouped_gemms_with_biases_compile_for_sm90():
    """The dense and w4a16 grouped GEMMs with an expert bias (gate_up's and down's, with the routing weight),
    compiled for an H100 / H200 on this machine (the installed triton and its ptxas, not the interpreter):
    tensor-core products, no local memory."""
    from tests.kernels.conftest import sm90_compile_facts

    facts = sm90_compile_facts(_COMPILE_SM90_BIAS)
    assert len(facts) == 4
    for name, kernel in facts.items():
        assert kernel["mma"] and not kernel["local"] and kernel["shared"] <= 227 * 1024, (name, kernel)
