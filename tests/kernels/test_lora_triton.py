"""Run-time LoRA's two Triton kernels (kernels/lora_triton.py) against float64: out[t] += x[t] @ A_sᵀ @ B_s for
each token's slot s (rows s·m·R ..+m·R of A and B), rows of slot -1 untouched bit for bit.

On the CPU they run in Triton's interpreter at small shapes (fp16 and fp32: the interpreter's tl.dot misreads
bfloat16, conftest): members m = 1, 2, 3, several slot counts and ranks, mixed slots and -1 in one tile, token
counts that are not a multiple of the tile, K splits, strided inputs and outputs, and LinearLora.add_to through
the kernels against its torch path. On the GPU (marked gpu)
Llama-3-8B's qkv and gate_up shapes with 4 slots of rank 16 at 1, 64 and 1024 tokens; and, on any machine
with triton's ptxas, both kernels compiled for sm_90.
"""

import pytest
import torch

from llmc.kernels import lora_triton
from tests.kernels.conftest import sm90_compile_facts


def _case(num_tokens, k, n, slots, rank, members, dtype, device, seed=0):
    """(x [T, K], A [S·m·R, K], B [S·m·R, N], token_slot [T] int32: 0 .. S-1, -1, then random, out [T, N])."""
    gen = torch.Generator().manual_seed(seed)
    rows = members * rank
    x = torch.randn(num_tokens, k, generator=gen)
    a = torch.randn(slots * rows, k, generator=gen) / k**0.5
    b = torch.randn(slots * rows, n, generator=gen) / rows**0.5
    token_slot = torch.randint(-1, slots, (num_tokens,), generator=gen, dtype=torch.int32)
    first = torch.tensor([*range(slots), -1], dtype=torch.int32)[:num_tokens]  # every slot, then none
    token_slot[: first.numel()] = first
    out = torch.randn(num_tokens, n, generator=gen)
    return [t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype) for t in (x, a, b, token_slot, out)]


def _reference(x, a, b, token_slot, out, slots):
    """(x @ A_sᵀ [T, m·R], out + x @ A_sᵀ @ B_s [T, N]) in float64, zeros / out itself for slot -1."""
    rows = a.shape[0] // slots
    xa = torch.zeros(x.shape[0], rows, dtype=torch.float64, device=x.device)
    want = out.double().clone()
    for s in range(slots):
        mine = token_slot == s
        xa[mine] = x[mine].double() @ a[s * rows : (s + 1) * rows].double().T
        want[mine] += xa[mine] @ b[s * rows : (s + 1) * rows].double()
    return xa, want


TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}  # relative, of the rows with a slot


def _check(got, want, out, token_slot, dtype, rel_err):
    none = token_slot < 0
    assert torch.equal(got[none], out[none]), "a row without a slot changed"
    some = ~none
    if some.any():  # the delta's error: out's own rounding to dtype included
        delta = got[some].double() - out[some].double()
        assert rel_err(delta, want[some] - out[some].double()) < TOLERANCE[dtype]


@pytest.mark.parametrize("members", [1, 2, 3])
@pytest.mark.parametrize("slots, rank", [(1, 8), (3, 4), (4, 16)])
@pytest.mark.parametrize("num_tokens", [1, 5, 37])
def test_shrink_and_expand_are_each_tokens_slot_in_float64(members, slots, rank, num_tokens, dot_case, rel_err):
    device, dtype = dot_case
    x, a, b, token_slot, out = _case(num_tokens, 72, 48, slots, rank, members, dtype, device)
    want_xa, want = _reference(x, a, b, token_slot, out, slots)
    parts = lora_triton.lora_shrink(x, a, token_slot, slots)
    assert parts.dtype == torch.float32 and parts.shape[1:] == (num_tokens, members * rank)
    xa = parts.sum(0)
    assert torch.equal(xa[token_slot < 0], torch.zeros_like(xa[token_slot < 0]))
    assert rel_err(xa, want_xa) < TOLERANCE[torch.float32 if dtype == torch.float32 else torch.float16] / 4
    got = lora_triton.lora_expand(out.clone(), parts, b, token_slot, slots)
    _check(got, want, out, token_slot, dtype, rel_err)


def test_many_tokens_take_the_wide_tiles(dot_case, rel_err):
    """1100 tokens (above 1024: the shrink's 64-token tiles; the expand's from 33 on), runs of one slot as a
    prefill's chunks give them, and a mixed tail."""
    device, dtype = dot_case
    x, a, b, token_slot, out = _case(1100, 40, 24, 4, 4, 3, dtype, device, seed=4)
    token_slot[:1000] = (torch.arange(1000, device=device) // 300 - 1).to(torch.int32)  # -1, 0, 1, 2 in runs
    _, want = _reference(x, a, b, token_slot, out, 4)
    got = lora_triton.lora_add(out.clone(), x, a, b, token_slot, 4)
    _check(got, want, out, token_slot, dtype, rel_err)


@pytest.mark.parametrize("splits, made", [(1, 1), (2, 2), (3, 2), (4, 4), (8, 4)])
def test_k_splits_give_the_same_sum(splits, made, dot_case, rel_err):
    """K = 200 (not a multiple of BLOCK_K: 4 steps of 64) in 1 to 8 splits asked: the steps shared evenly, no
    split empty (3 asked: 2 of 2 steps), the same result."""
    device, dtype = dot_case
    x, a, b, token_slot, out = _case(21, 200, 40, 3, 8, 2, dtype, device, seed=1)
    _, want = _reference(x, a, b, token_slot, out, 3)
    parts = lora_triton.lora_shrink(x, a, token_slot, 3, splits=splits, sum_splits=False)
    assert parts.shape[0] == made
    got = lora_triton.lora_expand(out.clone(), parts, b, token_slot, 3)
    _check(got, want, out, token_slot, dtype, rel_err)
    summed = lora_triton.lora_shrink(x, a, token_slot, 3, splits=splits)  # the last split to arrive sums them
    assert summed.shape[0] == 1
    assert torch.equal(summed[0], parts.sum(0)) if made <= 2 else torch.allclose(summed[0], parts.sum(0), atol=1e-5)
    got = lora_triton.lora_expand(out.clone(), summed, b, token_slot, 3)
    _check(got, want, out, token_slot, dtype, rel_err)


def test_strided_input_and_output_views(dot_case, rel_err):
    """x a column slice of a wider tensor, out every other column of one (the kernels take any strides)."""
    device, dtype = dot_case
    x, a, b, token_slot, out = _case(19, 64, 40, 2, 8, 3, dtype, device, seed=2)
    wide_x = torch.zeros(19, 100, dtype=dtype, device=device)
    wide_x[:, 10:74] = x
    wide_out = torch.zeros(19, 80, dtype=dtype, device=device)
    wide_out[:, ::2] = out
    _, want = _reference(x, a, b, token_slot, out, 2)
    lora_triton.lora_add(wide_out[:, ::2], wide_x[:, 10:74], a, b, token_slot, 2)
    _check(wide_out[:, ::2], want, out, token_slot, dtype, rel_err)
    assert torch.equal(wide_out[:, 1::2], torch.zeros_like(wide_out[:, 1::2]))


def test_longer_token_slot_and_no_tokens(device):
    """lora_add reads the first T entries of a longer token_slot (the step's buffer); T = 0 launches nothing."""
    x, a, b, token_slot, out = _case(6, 32, 16, 2, 4, 1, torch.float32, device)
    longer = torch.cat([token_slot, torch.ones(10, dtype=torch.int32, device=device)])
    _, want = _reference(x, a, b, token_slot, out, 2)
    got = lora_triton.lora_add(out.clone(), x, a, b, longer, 2)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    empty = torch.empty(0, 16, device=device)
    assert lora_triton.lora_add(empty, x[:0], a, b, longer, 2).shape == (0, 16)


def test_linear_lora_through_the_kernels_is_its_torch_path(device):
    """LinearLora.add_to with slots.kernels on (the CUDA dispatch, here in the interpreter on the CPU) against
    the same LinearLora on the torch path, after LoraSlots.set_mapping: qkv-like members, ranks below max."""
    from types import SimpleNamespace

    from llmc.runtime.lora import LinearLora, LoraSlots

    gen = torch.Generator().manual_seed(3)
    results = []
    for kernels in (False, True):
        slots = SimpleNamespace(max_loras=3, max_rank=8, dtype=torch.float32, device=torch.device(device))
        LoraSlots._init_mapping(slots, 32, kernels)
        lora = LinearLora(slots, [24, 8, 8], 48, None)
        gen.manual_seed(3)
        for slot, rank in enumerate([8, 3, 5]):
            lora.load(slot, [(torch.randn(rank, 48, generator=gen), torch.randn(rows, rank, generator=gen))
                             for rows in (24, 8, 8)])
        token_slots = [0, 2, -1, 1, 1, 0, -1, 2, 2, 0, 0]
        LoraSlots.set_mapping(slots, [1] * 32)  # a longer step before: its stale rows must not matter
        LoraSlots.set_mapping(slots, token_slots)
        assert slots.token_slot[: len(token_slots)].tolist() == token_slots
        x = torch.randn(len(token_slots), 48, generator=gen).to(device)
        base = torch.randn(len(token_slots), 40, generator=gen).to(device)
        results.append(lora.add_to(base.clone(), x))
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)


LLAMA3_8B = [(4096, 6144, 3), (4096, 28672, 2)]  # K, N, members: qkv, gate_up


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("k, n, members", LLAMA3_8B)
@pytest.mark.parametrize("num_tokens", [1, 64, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_at_llama_shapes(k, n, members, num_tokens, dtype, rel_err):
    """4 slots of rank 16, tokens spread over them and -1, as a decode batch mixes them."""
    x, a, b, token_slot, out = _case(num_tokens, k, n, 4, 16, members, dtype, "cuda")
    _, want = _reference(x, a, b, token_slot, out, 4)
    got = lora_triton.lora_add(out.clone(), x, a, b, token_slot, 4)
    _check(got, want, out, token_slot, dtype, rel_err)


_COMPILE_SM90 = r"""
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llmc.kernels import lora_triton as lt

def compile_90(fn, signature, constants):
    names = list(fn.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in signature.items()
             if t.startswith("*") or n in ("K", "N", "rows", "k_per_split", "stride_xm", "stride_am", "stride_bm",
                                             "stride_om")}
    constants = {**constants, "PRECISION": "tf32", "PDL": True}
    source = ASTSource(fn, {**signature, **{k: "constexpr" for k in constants}}, constants, attrs)
    try:
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except FileNotFoundError as exc:  # a triton without its bundled ptxas
        print("SKIP", exc)
        raise SystemExit(0)

facts = {}
common = {"slot_ptr": "*i32", "T": "i32", "rows": "i32", "num_slots": "i32"}
def record(name, kern):
    ptx = kern.asm["ptx"]
    facts[name] = {"mma": "mma.sync" in ptx or "wgmma" in ptx, "local": ".local" in ptx, "shared": kern.metadata.shared,
                   "griddepcontrol": "griddepcontrol.wait" in ptx}

for block_m in (16, 64):
    for block_r in (16, 64):
        record(f"shrink {block_m} {block_r}", compile_90(
            lt._shrink_kernel, {"x_ptr": "*bf16", "a_ptr": "*bf16", **common, "part_ptr": "*fp32", "xa_ptr": "*fp32",
                                "counter_ptr": "*i32", "K": "i32", "k_per_split": "i32", "splits": "i32",
                                "stride_xm": "i32", "stride_xk": "constexpr", "stride_am": "i32"},
            {"stride_xk": 1, "SUM_SPLITS": True, "BLOCK_M": block_m, "BLOCK_R": block_r, "BLOCK_K": lt.BLOCK_K}))
        for block_n in (64, 128):
            record(f"expand {block_m} {block_r} {block_n}", compile_90(
                lt._expand_kernel, {"part_ptr": "*fp32", "b_ptr": "*bf16", **common, "out_ptr": "*bf16", "N": "i32",
                                    "splits": "i32", "stride_bm": "i32", "stride_om": "i32", "stride_on": "constexpr"},
                {"stride_on": 1, "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_R": block_r}))
print(json.dumps(facts))
"""


def test_kernels_compile_for_sm90() -> None:
    """Both kernels at every tile size the wrappers choose, bf16, compiled for an H100/H200 on this machine (the
    installed triton and its ptxas, in a process of its own: the tests here run the interpreter): tensor-core
    products, no local memory (spills), shared memory that fits, the PDL wait in."""
    facts = sm90_compile_facts(_COMPILE_SM90)
    assert len(facts) == 4 + 8
    for tiles, kernel in facts.items():
        assert kernel["mma"] and not kernel["local"] and kernel["griddepcontrol"], tiles
        assert kernel["shared"] <= 227 * 1024, tiles
