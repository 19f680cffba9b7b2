"""The state layers' Triton kernels (kernels/recurrent_triton.py) against the layers' torch forms in float64, over a
step of sequences of different lengths (one-token decodes among them), some starting fresh, some continuing from their
slots' states, the slots out of order and one slot left untouched: the outputs, and every slot's state after the
step. States are float32 or 16-bit (runtime.mamba_ssm_cache_dtype / mamba_cache_dtype): a 16-bit state is read once
into float32 and rounded once, at its piece's end, so the outputs are the float64 ones from the stored start state and
the state after the piece the float64 one rounded (STATE_RTOL)."""

import pytest
import torch

from llmc.kernels import recurrent
from llmc.runtime.models.gated_deltanet import l2_normalize, recurrent_delta_rule
from llmc.runtime.models.mamba2 import causal_conv, gated_group_norm, ssd_step

# what rounding the float64 state to a state dtype may move it by, relative: half a unit in the last place (a GPU rounds
# to nearest), a whole unit for bfloat16 in Triton's interpreter (which truncates float32 to bfloat16)
STATE_RTOL = {torch.float32: 2e-5, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def _rounded(x: torch.Tensor, dtype: torch.dtype, device: str) -> torch.Tensor:
    """float32 x rounded to dtype as the kernel rounds it: to nearest on a GPU; Triton's interpreter truncates to
    bfloat16 (the low 16 bits of the float32 dropped)."""
    if device == "cpu" and dtype == torch.bfloat16:
        return (x.float().view(torch.int32) & -65536).view(torch.float32).to(dtype)
    return x.to(dtype)


def _state_rtol(device: str, state_dtype: torch.dtype) -> float:
    return STATE_RTOL[state_dtype] * (2 if device == "cpu" and state_dtype == torch.bfloat16 else 1)
def _atol(want: torch.Tensor, device: str, chunked: bool) -> float:
    """The absolute tolerance of a piece's outputs or state: a float32 path's rounding (2e-5); on the chunked kernels
    a chunk's values are sums of up to 64 products as large as themselves (here outputs up to ~40, dt to ~6), so
    their rounding is relative to the piece's largest value: float32's in the interpreter, tf32's (a 10-bit
    mantissa: kernels/recurrent_triton.DOT_PRECISION) on a GPU."""
    if not chunked:
        return 2e-5
    return max(2e-5, (1e-5 if device == "cpu" else 4e-3) * float(want.abs().max()))


LENGTHS = [1, 7, 1, 19, 33]  # a step's pieces, in row order (the conv also a decode step's and a short one's)
LONG = [1, 70, 1, 129, 64]  # pieces of several chunks (kernels/recurrent_triton.CHUNK: 64), one ending on a chunk's end
FRESH = [False, True, True, False, False]
SLOTS = [4, 0, 2, 5, 1]  # slot 3 belongs to no sequence of the step


def _steps(device, lengths=LENGTHS):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return recurrent.StateSteps(cu, torch.tensor(SLOTS, device=device), torch.tensor(FRESH, device=device),
                                max(lengths), sum(length >= recurrent.CHUNKED_FROM for length in lengths))


def _pieces(lengths=LENGTHS):
    start = 0
    for i, length in enumerate(lengths):
        yield i, slice(start, start + length)
        start += length


@pytest.mark.parametrize("kernel, silu, bias, lengths, state_dtype", [
    (4, True, False, LENGTHS, None), (4, False, True, LENGTHS, None), (3, False, False, LENGTHS, None),
    (4, True, True, [1] * 5, None), (4, False, False, [2, 1, 9, 1, 16], None), (4, True, False, LENGTHS, torch.float32),
    (4, True, False, [1] * 5, torch.float32)])
def test_the_causal_conv_is_the_torch_conv(elementwise_case, kernel, silu, bias, lengths, state_dtype):
    """Pieces longer than a token block (a second launch writes the states), a decode step's and short pieces (one
    launch); the state in the inputs' dtype, or in float32 (mamba_cache_dtype float32)."""
    device, dtype = elementwise_case
    state_dtype = state_dtype or dtype
    torch.manual_seed(0)
    channels, total = 40, sum(lengths)
    x = torch.randn(total, channels, device=device).to(dtype)
    weight = torch.randn(channels, kernel, device=device).to(dtype)
    b = torch.randn(channels, device=device).to(dtype) if bias else None
    state = torch.randn(6, channels, kernel - 1, device=device).to(dtype).to(state_dtype)
    before = state.clone()
    out = recurrent.causal_conv(x, weight, b, state, _steps(device, lengths), silu, torch.float32)
    for i, rows in _pieces(lengths):
        start = torch.zeros_like(before[0]) if FRESH[i] else before[SLOTS[i]]
        expected, new = causal_conv(x[rows].double(), weight.double(), None if b is None else b.double(),
                                    start.double(), silu)
        torch.testing.assert_close(out[rows].double(), expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state[SLOTS[i]].double(), new.to(state_dtype).double(), atol=0, rtol=0)
    torch.testing.assert_close(state[3], before[3], atol=0, rtol=0)


@pytest.mark.parametrize("group, key_dim, value_dim, lengths, state_dtype, beta_scale, chunked_from", [
    (2, 16, 16, LENGTHS, torch.float32, 1.0, 64), (1, 32, 48, LENGTHS, torch.float32, 2.0, 64),
    (1, 32, 80, [1] * 5, torch.float32, 2.0, 64), (2, 16, 16, LENGTHS, torch.bfloat16, 1.0, 64),
    (1, 32, 80, [1] * 5, torch.float16, 1.0, 64), (2, 16, 16, LENGTHS, torch.float32, 1.0, 2),
    (1, 32, 48, LONG, torch.float32, 2.0, 64), (2, 16, 16, LONG, torch.bfloat16, 1.0, 64),
    (1, 32, 80, LONG, torch.float32, 1.0, 64)])
def test_the_delta_rule_is_the_recurrent_torch_form(elementwise_case, monkeypatch, group, key_dim, value_dim, lengths,
                                                    state_dtype, beta_scale, chunked_from):
    """Prefill pieces and a decode step (each with its own tiles: kernels/recurrent.DELTA_RULE_TILES); float32 and
    16-bit states; the gates from the raw projections (g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) in
    the inputs' dtype times beta_scale: 2 is OLMo Hybrid's allow_neg_eigval). A step whose longest piece has
    CHUNKED_FROM tokens runs the chunked kernels: pieces of several chunks, one ending on a chunk's end, decodes
    among them (chunks of one token), short pieces forced onto them, and value tiles masked at the value heads' end (80
of 128; a GPU takes the narrow tile here, recurrent.CHUNKED_NARROW: few programs)."""
    monkeypatch.setattr(recurrent, "CHUNKED_FROM", chunked_from)
    device, dtype = elementwise_case
    torch.manual_seed(1)
    key_heads, total = 2, sum(lengths)
    heads = key_heads * group
    q, k = (torch.randn(total, key_heads * key_dim, device=device).to(dtype) for _ in range(2))
    v = torch.randn(total, heads * value_dim, device=device).to(dtype)
    ab = (torch.randn(total, 2 * heads, device=device) * 3).to(dtype)  # a's columns, then b's: one row stride
    a, b = ab[:, :heads], ab[:, heads:]
    a_log, dt_bias = torch.rand(heads, device=device) - 0.5, torch.randn(heads, device=device)
    g = -a_log.double().exp() * torch.nn.functional.softplus(a.double() + dt_bias.double())
    # beta in the inputs' dtype, as the model computes it: in the kernel for a decode step, by torch before a prefill's
    # (kernels/recurrent.GATES_IN_KERNEL)
    beta = (_rounded(b.float().sigmoid(), dtype, device) if max(lengths) == 1 else b.sigmoid()).double() * beta_scale
    state = (torch.randn(6, heads, key_dim, value_dim, device=device) * 0.3).to(state_dtype)
    before = state.clone()
    scale = key_dim ** -0.5
    out = recurrent.delta_rule(q, k, v, a, b, a_log, dt_bias, beta_scale, state, _steps(device, lengths), scale, 1e-6)
    for i, rows in _pieces(lengths):
        qs, ks = (l2_normalize(t[rows].double().unflatten(-1, (key_heads, key_dim))).repeat_interleave(group, 1)
                  for t in (q, k))
        start = torch.zeros_like(before[0]) if FRESH[i] else before[SLOTS[i]]
        expected, new = recurrent_delta_rule((qs * scale)[None], ks[None], v[rows].double().unflatten(-1, (heads, -1))[None],
                                             g[rows][None], beta[rows][None], start.double()[None])
        chunked = max(lengths) >= chunked_from and lengths[i] >= chunked_from
        torch.testing.assert_close(out[rows].double(), expected[0].flatten(1),
                                   atol=_atol(expected[0], device, chunked), rtol=2e-5)
        torch.testing.assert_close(state[SLOTS[i]].double(), new[0], atol=_atol(new[0], device, chunked),
                                   rtol=_state_rtol(device, state_dtype))
    torch.testing.assert_close(state[3], before[3], atol=0, rtol=0)


def test_the_gated_rms_norm_is_the_float64_form(elementwise_case):
    """Qwen3.5's gated RMSNorm (one launch in place of the torch form's ~14) against float64 with the model's rounding
    points (the rule's output, the normed row and w times it, each in the inputs' dtype), over 5 heads of 24 (head
    blocks and columns masked) and a gate z read with a row stride (a column slice, as the layer's split gives)."""
    device, dtype = elementwise_case
    torch.manual_seed(3)
    heads, head_dim, rows = 5, 24, 7
    o = torch.randn(rows, heads * head_dim, device=device) * 2
    z = torch.randn(rows, 3 * heads * head_dim, device=device).to(dtype)[:, heads * head_dim:2 * heads * head_dim]
    weight = (torch.rand(head_dim, device=device) + 0.5).to(dtype)
    got = recurrent.gated_rms_norm(o, z, weight, 1e-6)
    od = _rounded(o, dtype, device).double().unflatten(-1, (heads, head_dim))
    normed = _rounded((od * torch.rsqrt(od.pow(2).mean(-1, keepdim=True) + 1e-6)).float(), dtype, device)
    weighted = _rounded((weight.double() * normed.double()).float(), dtype, device).double()
    zd = z.double().unflatten(-1, (heads, head_dim))
    want = (weighted * zd * torch.sigmoid(zd)).flatten(1)
    assert got.dtype == dtype
    # a unit in the last place (the output's rounding; a rounding point's float32 and float64 values may also fall
    # on either side of a tie)
    rtol = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[dtype]
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=rtol)


@pytest.mark.parametrize("groups, head_dim, d_state, lengths, state_dtype, chunked_from", [
    (2, 8, 16, LENGTHS, torch.float32, 64), (1, 12, 32, LENGTHS, torch.float32, 64),
    (2, 40, 16, [1] * 5, torch.float32, 64), (2, 8, 16, LENGTHS, torch.bfloat16, 64),
    (2, 40, 16, [1] * 5, torch.float16, 64), (1, 12, 32, LENGTHS, torch.float32, 2),
    (2, 40, 16, LONG, torch.float32, 64), (2, 8, 16, LONG, torch.bfloat16, 64)])
def test_the_ssd_recurrence_is_the_torch_step(elementwise_case, monkeypatch, groups, head_dim, d_state, lengths,
                                              state_dtype, chunked_from):
    """Prefill pieces and a decode step (each with its own tiles: kernels/recurrent.SSD_TILES); float32 and 16-bit
    states; the time step softplus(dt + dt_bias) from the raw projection (a column slice: its own row stride) and
    a = -exp(A_log), in the kernel. Steps of long pieces (and short ones forced) on the chunked kernel, as the delta
    rule's."""
    monkeypatch.setattr(recurrent, "CHUNKED_FROM", chunked_from)
    device, dtype = elementwise_case
    torch.manual_seed(2)
    heads, total = 4, sum(lengths)
    x = torch.randn(total, heads * head_dim, device=device).to(dtype)
    b, c = (torch.randn(total, groups * d_state, device=device).to(dtype) for _ in range(2))
    raw_dt = (torch.randn(total, 3 * heads, device=device) * 2).to(dtype)[:, heads:2 * heads]
    dt_bias, a_log = torch.randn(heads, device=device), torch.rand(heads, device=device) * 1.5 - 0.5
    dt = torch.nn.functional.softplus(raw_dt.double() + dt_bias.double())
    a, d = -a_log.double().exp(), torch.randn(heads, device=device)
    state = (torch.randn(6, heads, head_dim, d_state, device=device) * 0.3).to(state_dtype)
    before = state.clone()
    out = recurrent.ssd(x, raw_dt, dt_bias, a_log, b, c, d, state, _steps(device, lengths))
    for i, rows in _pieces(lengths):
        s = torch.zeros_like(before[0]).double() if FRESH[i] else before[SLOTS[i]].double()
        want = torch.stack([ssd_step(x[t].double().unflatten(-1, (heads, head_dim)), dt[t], a,
                                     b[t].double().unflatten(-1, (groups, d_state)),
                                     c[t].double().unflatten(-1, (groups, d_state)), d.double(), s).flatten()
                            for t in range(rows.start, rows.stop)])
        chunked = max(lengths) >= chunked_from and lengths[i] >= chunked_from
        torch.testing.assert_close(out[rows].double(), want, atol=_atol(want, device, chunked), rtol=2e-5)
        torch.testing.assert_close(state[SLOTS[i]].double(), s, atol=_atol(s, device, chunked),
                                   rtol=_state_rtol(device, state_dtype))
    torch.testing.assert_close(state[3], before[3], atol=0, rtol=0)


@pytest.mark.parametrize("norm", [True, False])
def test_the_gated_group_norm_is_the_torch_form(elementwise_case, norm):
    """Mamba-2's gated norm (one launch in place of the torch form's ~10) against mamba2.gated_group_norm in float64:
    3 groups of 40 columns (masked in a block of 64), a gate read with a row stride; without a weight (Falcon-H1's
    mamba_rms_norm false) y silu(z) alone."""
    device, dtype = elementwise_case
    torch.manual_seed(4)
    groups, width, rows = 3, 120, 5
    y = torch.randn(rows, width, device=device) * 2
    z = torch.randn(rows, 2 * width, device=device).to(dtype)[:, width:]
    weight = (torch.rand(width, device=device) + 0.5).to(dtype) if norm else None
    got = recurrent.gated_group_norm(y, z, weight, groups, 1e-5, dtype)
    if norm:
        want = gated_group_norm(y.double(), z.double(), weight.double(), groups, 1e-5)
    else:
        want = y.double() * torch.nn.functional.silu(z.double())
    assert got.dtype == dtype
    rtol = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}[dtype]  # (the output's rounding)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=rtol)


_COMPILE_SM90 = r"""
import json, re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llmc.kernels import recurrent as r, recurrent_triton as rt

TILE_NAMES = ("C", "BK", "BV", "BP", "BN", "PRECISION")


def compile_90(fn, pointers, floats, constants, tiles):
    signature = {n: pointers.get(n, "*fp32") if n.endswith("_ptr") else "fp32" if n in floats else "i32"
                 for n in fn.arg_names if n not in TILE_NAMES}
    names = list(fn.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items() if t.startswith("*")}
    source = ASTSource(fn, {**signature, **{k: "constexpr" for k in constants}}, constants, attrs)
    try:
        k = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": tiles[1], "num_stages": tiles[2]})
    except FileNotFoundError as exc:  # a triton without its bundled ptxas
        print("SKIP", exc)
        raise SystemExit(0)
    return {"shared": k.metadata.shared, "wgmma_tf32": len(re.findall(r"wgmma\.mma_async[^\n]*tf32", k.asm["ptx"]))}


seqs = {"cu_ptr": "*i32", "slot_ptr": "*i64", "fresh_ptr": "*i1"}
qk = {"q_ptr": "*bf16", "k_ptr": "*bf16"}
delta, ssd = r.CHUNKED_TILES["delta_rule"], r.CHUNKED_TILES["ssd"]
shapes = {"C": r.CHUNK, "PRECISION": rt.DOT_PRECISION}
print(json.dumps({
    "prep": compile_90(rt._delta_rule_prep_kernel, {**qk, **seqs, "v_ptr": "*bf16"}, ("scale", "eps"),
                       {**shapes, "BK": 128, "BV": 128}, delta),
    "scan": compile_90(rt._delta_rule_scan_kernel, {**qk, **seqs}, ("scale", "eps"),
                       {**shapes, "BK": 128, "BV": delta[0]}, delta),
    "ssd": compile_90(rt._ssd_chunked_kernel, seqs, (), {**shapes, "BP": ssd[0], "BN": 128}, ssd)}))
"""


def test_the_chunked_kernels_fit_a_hopper_at_the_published_shapes():
    """The chunked kernels compiled for sm_90 by the installed triton (in a process of its own, not interpreted) at
    their tiles (kernels/recurrent.CHUNKED_TILES) and Qwen3.5-9B's / Nemotron-H-8B's head sizes (key and value dims
    128; head_dim 64, d_state 128): each fits the H100's / H200's 227 KiB of shared memory (the first form's pipelined
    loads asked 287,232 bytes there, session 53) and runs its products on tf32 wgmma."""
    from tests.kernels.conftest import sm90_compile_facts

    facts = sm90_compile_facts(_COMPILE_SM90)
    for name, kernel in facts.items():
        assert kernel["shared"] <= 227 * 1024 and kernel["wgmma_tf32"] > 0, (name, kernel)
