"""DeepSeek's latent attention over the paged latent cache (kernels/mla_attention.py): the Triton kernel of the absorbed
form (under TRITON_INTERPRET=1 on CPU tensors, small shapes; on a GPU, -m gpu, DeepSeek-V2-Lite's shape) and the torch
path's absorbed and expanded forms, against a float64 reference that expands every head's key and value from the
cached latents (k_nope = W_UK c_kv, v = W_UV c_kv) and runs plain causal attention: the MLA definition, not the
absorption."""

import math

import pytest
import torch

from llmc.kernels import attention, mla_attention


def make_step(context_lens, query_lens, num_heads, nope, rope, v_dim, rank, block_size, dtype, device, seed=0,
              cache_dtype=None, kv_scale=1.0):
    """q, the latent cache (slots no sequence owns: NaN, block 0 too), block tables, W_UK, W_UV of a step; and the
    float64 latents each sequence wrote (as the cache holds them: FP8-rounded where it is FP8)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = torch.zeros(len(context_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    cache_dtype = cache_dtype or dtype
    cache = torch.full((num_blocks, block_size, rank + rope), float("nan"), dtype=dtype).to(cache_dtype)
    latents = []
    for seq, (context_len, n_blocks) in enumerate(zip(context_lens, blocks_per_seq)):
        blocks = torch.tensor([order.pop() for _ in range(n_blocks)], dtype=torch.int32)
        tables[seq, :n_blocks] = blocks
        slots = (blocks.long()[:, None] * block_size + torch.arange(block_size)).flatten()[:context_len]
        c_kv = torch.randn(context_len, rank, generator=gen).to(dtype)
        k_pe = torch.randn(context_len, rope, generator=gen).to(dtype)
        mla_attention.write_latent_cache(c_kv, k_pe, cache, slots, kv_scale)
        latents.append(cache.view(-1, rank + rope)[slots].double() * (kv_scale if cache_dtype != dtype else 1.0))
    q = torch.randn(sum(query_lens), num_heads, nope + rope, generator=gen).to(dtype)
    w_uk = (torch.randn(num_heads, nope, rank, generator=gen) * rank ** -0.5).to(dtype)
    w_uv = (torch.randn(num_heads, v_dim, rank, generator=gen) * rank ** -0.5).to(dtype)
    return [t.to(device) for t in (q, cache, tables, w_uk, w_uv)], latents


def reference(q, latents, w_uk, w_uv, query_lens, scale):
    """Per sequence and head, in float64: K = [W_UK c_kv, k_pe], V = W_UV c_kv, causal softmax(q K^T * scale) V."""
    q, w_uk, w_uv = q.cpu().double(), w_uk.cpu().double(), w_uv.cpu().double()
    nope, rank = w_uk.shape[1], w_uk.shape[2]
    out, start = [], 0
    for latent, n in zip(latents, query_lens):
        c_kv, k_pe = latent[:, :rank], latent[:, rank:]
        context, heads = latent.shape[0], q.shape[1]
        k = torch.cat((c_kv @ w_uk.transpose(1, 2), k_pe.expand(heads, -1, -1)), dim=-1)  # [heads, context, q/k dims]
        v = c_kv @ w_uv.transpose(1, 2)  # [heads, context, v dims]
        scores = q[start : start + n].transpose(0, 1) @ k.transpose(1, 2) * scale  # [heads, n, context]
        position = torch.arange(context - n, context)[:, None]  # query i sees keys 0..its own position
        scores = scores.masked_fill(torch.arange(context)[None, :] > position, float("-inf"))
        out.append((torch.softmax(scores, dim=-1) @ v).transpose(0, 1))
        start += n
    return torch.cat(out)


CASES = {
    # name: (context_lens, query_lens, num_heads, nope, rope, v_dim, rank, block_size, partitions)
    "decode": ([1, 17, 100], [1, 1, 1], 4, 16, 16, 16, 32, 16, 1),
    "chunked-mixed": ([40, 9, 70], [13, 1, 70], 4, 16, 16, 8, 32, 8, 1),
    "uneven-dims-and-many-heads": ([33, 5], [1, 5], 20, 12, 4, 8, 24, 16, 1),  # two head blocks; masked 24 + 4 dims
    # the keys split over partitions of 64 (a decode of few rows on a GPU): empty ones (a 1-token context), merged
    "split-decode": ([1, 17, 300], [1, 1, 1], 4, 16, 16, 16, 32, 16, 5),
    "split-mixed": ([130, 9, 40], [5, 1, 9], 4, 12, 4, 8, 24, 8, 3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_absorbed_kernel_matches_float64(dot_case, rel_err, case):
    from llmc.kernels.mla_attention_triton import mla_absorbed_attention

    device, dtype = dot_case
    context_lens, query_lens, heads, nope, rope, v_dim, rank, block_size, partitions = CASES[case]
    (q, cache, tables, w_uk, w_uv), latents = make_step(context_lens, query_lens, heads, nope, rope, v_dim, rank,
                                                        block_size, dtype, device)
    scale = (nope + rope) ** -0.5
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=device)
    row_seq, row_limit = mla_attention.row_index(query_lens, ctx, q.shape[0], None, None)
    q_nope, q_pe = q.split([nope, rope], dim=-1)
    q_lat = torch.einsum("thn,hnr->thr", q_nope.double(), w_uk.double()).to(dtype)
    out_lat = mla_absorbed_attention(q_lat, q_pe, cache, tables, row_seq, row_limit, scale,
                                     max_context_len=max(context_lens), partitions=partitions)
    assert out_lat.shape == (q.shape[0], heads, rank) and torch.isfinite(out_lat).all()
    got = torch.einsum("thr,hvr->thv", out_lat.double(), w_uv.double())
    assert rel_err(got.cpu(), reference(q, latents, w_uk, w_uv, query_lens, scale)) < (
        1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("form", mla_attention.FORMS + (None,))
def test_the_torch_forms_match_float64(form, rel_err):
    """The CPU path, absorbed, expanded (kv_b of the context's latents) and by the measured rule: float64's."""
    context_lens, query_lens, heads, nope, rope, v_dim, rank, block_size, _ = CASES["chunked-mixed"]
    (q, cache, tables, w_uk, w_uv), latents = make_step(context_lens, query_lens, heads, nope, rope, v_dim, rank,
                                                        block_size, torch.float64, "cpu")

    def expand(c_kv):
        return torch.einsum("kr,hnr->khn", c_kv, w_uk), torch.einsum("kr,hvr->khv", c_kv, w_uv)

    scale = (nope + rope) ** -0.5
    out = mla_attention.mla_attention(q, cache, w_uk, w_uv, tables, torch.tensor(context_lens), query_lens, scale,
                                      expand=expand, form=form)
    assert rel_err(out, reference(q, latents, w_uk, w_uv, query_lens, scale)) < 1e-12


def test_an_fp8_cache_holds_the_latent_with_one_scale(rel_err):
    """An FP8 latent cache: [c_kv, k_pe] stored as clamp(x / scale) in E4M3, read back times the scale by the kernel
    and the torch path; both give float64's attention over those rounded latents."""
    from llmc.kernels.mla_attention_triton import mla_absorbed_attention

    context_lens, query_lens, heads, nope, rope, v_dim, rank, block_size, _ = CASES["chunked-mixed"]
    scale_kv = 0.05
    (q, cache, tables, w_uk, w_uv), latents = make_step(context_lens, query_lens, heads, nope, rope, v_dim, rank,
                                                        block_size, torch.float32, "cpu",
                                                        cache_dtype=torch.float8_e4m3fn, kv_scale=scale_kv)
    assert cache.dtype == torch.float8_e4m3fn
    scale = (nope + rope) ** -0.5
    want = reference(q, latents, w_uk, w_uv, query_lens, scale)
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    torch_out = mla_attention.mla_attention(q, cache, w_uk, w_uv, tables, ctx, query_lens, scale, kv_scale=scale_kv)
    assert rel_err(torch_out, want) < 1e-5
    row_seq, row_limit = mla_attention.row_index(query_lens, ctx, q.shape[0], None, None)
    q_lat = torch.einsum("thn,hnr->thr", q[..., :nope], w_uk)
    out_lat = mla_absorbed_attention(q_lat, q[..., nope:], cache, tables, row_seq, row_limit, scale, scale_kv)
    assert rel_err(torch.einsum("thr,hvr->thv", out_lat, w_uv), want) < 1e-5


def test_a_prefill_index_gives_each_row_its_sequence_and_prefix():
    """A mixed CUDA graph's step (attention.PrefillIndex: blocks of queries, an unused sequence with stale values,
    the padding sequence) gives each query row the sequence and causal prefix that its host query_lens give, and the
    padding rows a prefix of 0 keys, from device tensors alone."""
    context_lens, query_lens, size, per_block = [40, 17, 9, 33, 1], [13, 1, 1, 33, 1], 64, 16
    blocks = attention.prefill_blocks(query_lens, per_block)
    num_blocks, pad = attention.max_prefill_blocks(size, 6, per_block), 6
    i32 = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    index = attention.PrefillIndex(
        query_lens=i32(query_lens + [0, 0]), first_rows=i32([0, 13, 14, 15, 48, 7, 0]),
        block_seqs=i32([seq for seq, _ in blocks] + [pad] * (num_blocks - len(blocks))),
        block_starts=i32([start for _, start in blocks] + [0] * (num_blocks - len(blocks))),
        queries_per_block=per_block, out=torch.zeros(size, 1, 1))
    row_seq, row_limit = mla_attention.row_index([size], i32(context_lens + [9, 0]), size, None, index)
    host_seq, host_limit = mla_attention.row_index(query_lens, i32(context_lens), sum(query_lens), None, None)
    n = sum(query_lens)
    assert torch.equal(row_seq[:n], host_seq) and torch.equal(row_limit[:n], host_limit)
    assert host_limit[:13].tolist() == list(range(28, 41)) and host_limit[13:15].tolist() == [17, 9]
    assert row_limit[n:].eq(0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("context_lens, query_lens", [([1, 700, 333, 129], [1, 1, 200, 129]), ([2000, 37], [1, 1])])
def test_the_kernel_at_deepseek_v2_lite_shape_on_the_gpu(dtype, context_lens, query_lens, rel_err):
    """DeepSeek-V2-Lite's attention (16 heads, 128 + 64 q/k dims, 128 v dims, latent 512 + 64, blocks of 16) through
    mla_attention on CUDA (the absorbed kernel for every row: decode rows, a chunk after a cached prefix, a fresh
    prompt; and a decode of two rows, whose keys the kernel splits over partitions): float64's expanded attention."""
    (q, cache, tables, w_uk, w_uv), latents = make_step(context_lens, query_lens, 16, 128, 64, 128, 512, 16, dtype,
                                                        "cuda")
    scale = 192 ** -0.5
    out = mla_attention.mla_attention(q, cache, w_uk, w_uv, tables, torch.tensor(context_lens, dtype=torch.int32,
                                                                                   device="cuda"), query_lens, scale,
                                      max_context_len=max(context_lens))
    assert out.shape == (q.shape[0], 16, 128) and torch.isfinite(out).all()
    assert rel_err(out.cpu(), reference(q, latents, w_uk, w_uv, query_lens, scale)) < 2e-2


_COMPILE_SM90 = r"""
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llmc.kernels import mla_attention_triton as mt

facts = {}
for split in (False, True):  # (split: the partitions' outputs in float32)
    sig = {"q_lat_ptr": "*bf16", "q_pe_ptr": "*bf16", "cache_ptr": "*bf16", "bt_ptr": "*i32", "row_seq_ptr": "*i32",
           "row_limit_ptr": "*i32", "out_ptr": "*fp32" if split else "*bf16", "ml_ptr": "*fp32",
           **{s: "i32" for s in ("stride_qlt", "stride_qlh", "stride_qpt", "stride_qph", "stride_slot", "stride_bt",
                                 "stride_ot", "stride_oh", "num_heads", "num_rows", "partition_size")},
           "scale_log2": "fp32", "kv_scale": "fp32"}
    constants = {"RANK": 512, "ROPE": 64, "BLOCK_R": 512, "BLOCK_P": 64, "BLOCK_SIZE": 16, "BLOCK_H": mt.BLOCK_H,
                 "BLOCK_N": mt.BLOCK_N, "PRECISION": "tf32", "SPLIT": split}
    names = list(mt._mla_kernel.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*")}
    source = ASTSource(mt._mla_kernel, {**sig, **{k: "constexpr" for k in constants}}, constants, attrs)
    try:
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    except FileNotFoundError as exc:  # a triton without its bundled ptxas
        print("SKIP", exc)
        raise SystemExit(0)
    ptx = kernel.asm["ptx"]
    facts[str(split)] = {"mma": "mma.sync" in ptx or "wgmma" in ptx, "local": ".local" in ptx,
                         "shared": kernel.metadata.shared}
print(json.dumps(facts))
"""


def test_the_kernel_compiles_for_sm90_at_the_deepseek_shape():
    """The kernel, unsplit and split, at DeepSeek-V2 / V3's latent (512 + 64, bf16, blocks of 16 tokens) compiled for
    an H100 / H200 on this machine (the installed triton and its ptxas, in a process of its own): tensor-core products,
    no local memory, shared memory that fits."""
    from tests.kernels.conftest import sm90_compile_facts

    facts = sm90_compile_facts(_COMPILE_SM90)
    assert len(facts) == 2
    for split, kernel in facts.items():
        assert kernel["mma"] and not kernel["local"] and kernel["shared"] <= 227 * 1024, (split, kernel)


def _expand_of(w_uk, w_uv):
    """kv_b of the test's weights: (k_nope, v) of latents c_kv [n, rank], as MLAttention.expand returns them."""
    return lambda c_kv: (torch.einsum("kr,hnr->khn", c_kv, w_uk), torch.einsum("kr,hvr->khv", c_kv, w_uv))


EXPANDED_CASES = {
    # name: (context_lens, query_lens, cache dtype, kv_scale)
    "fresh-prompt": ([37], [37], None, 1.0),  # queries == keys: plain causal
    "chunk-after-cached-tokens": ([70], [23], None, 1.0),  # lower-right: query i sees keys 0..47 + i
    "several-sequences": ([40, 9, 70, 5], [13, 1, 70, 2], None, 1.0),
    "fp8-latent-cache": ([40, 70], [13, 31], torch.float8_e4m3fn, 0.05),
}


@pytest.mark.parametrize("chunked", [False, True], ids=["one-call", "query-chunks"])
@pytest.mark.parametrize("case", list(EXPANDED_CASES))
def test_the_expanded_form_matches_float64(case, chunked, monkeypatch, rel_err):
    """mla_attention's expanded form (expanded_attention: scaled_dot_product_attention over kv_b's keys, the queries
    at the context's end) on a CPU: float64's plain causal attention, also with its queries split into chunks of 4
    (EXPAND_MAX_SCORES), each chunk against its own causal prefix of the keys."""
    context_lens, query_lens, cache_dtype, kv_scale = EXPANDED_CASES[case]
    heads, nope, rope, v_dim, rank, block_size = 4, 16, 16, 8, 32, 8
    dtype = torch.float64 if cache_dtype is None else torch.float32  # (an FP8 cache is read in float32)
    if chunked:
        monkeypatch.setattr(mla_attention, "EXPAND_MAX_SCORES", 4 * heads * max(context_lens))
    (q, cache, tables, w_uk, w_uv), latents = make_step(context_lens, query_lens, heads, nope, rope, v_dim, rank,
                                                        block_size, dtype, "cpu", cache_dtype=cache_dtype,
                                                        kv_scale=kv_scale)
    scale = (nope + rope) ** -0.5
    out = mla_attention.mla_attention(q, cache, w_uk, w_uv, tables, torch.tensor(context_lens), query_lens, scale,
                                      kv_scale=kv_scale, expand=_expand_of(w_uk, w_uv), form="expanded")
    assert out.dtype == dtype and out.shape == (sum(query_lens), heads, v_dim)
    assert rel_err(out, reference(q, latents, w_uk, w_uv, query_lens, scale)) < (
        1e-12 if dtype == torch.float64 else 1e-5)


KEY_CHUNK_CASES = {
    # name: (context_lens, query_lens, keys per chunk)
    "one-chunk": ([37], [37], 64),  # a whole prompt within one chunk: causal, nothing to merge across chunks
    "several-chunks-queries-in-the-last": ([70], [6], 16),  # keys 0..63 unmasked in 4 chunks, 64..69 causal
    "queries-span-a-chunk-boundary": ([70], [23], 16),  # keys 32..47: cached 32..46 and query 47's own
    "chunk-size-one": ([20, 9], [7, 9], 1),  # every key its own chunk
    "exact-multiple": ([64, 48], [20, 48], 16),  # the last chunk full
    "several-sequences": ([40, 9, 70, 5], [13, 1, 70, 2], 8),
}


@pytest.mark.parametrize("blocks", [False, True], ids=["one-call-a-chunk", "query-blocks"])
@pytest.mark.parametrize("case", list(KEY_CHUNK_CASES))
def test_the_expanded_form_in_chunks_of_keys_matches_float64(case, blocks, monkeypatch, rel_err):
    """The expanded form with the context expanded in chunks of few keys (EXPAND_MAX_KEY_HEADS lowered to the chunk
    times the heads): each chunk's output and log-sum-exp merged give float64's plain causal attention over the
    whole context (1e-12), also with the queries of a chunk in blocks of 3 (EXPAND_MAX_SCORES); kv_b never sees more
    than a chunk of keys at once, and sees each key once per sequence."""
    context_lens, query_lens, chunk = KEY_CHUNK_CASES[case]
    heads, nope, rope, v_dim, rank, block_size = 4, 16, 16, 8, 32, 8
    monkeypatch.setattr(mla_attention, "EXPAND_MAX_KEY_HEADS", chunk * heads)
    if blocks:
        monkeypatch.setattr(mla_attention, "EXPAND_MAX_SCORES", 3 * heads * chunk)
    (q, cache, tables, w_uk, w_uv), latents = make_step(context_lens, query_lens, heads, nope, rope, v_dim, rank,
                                                        block_size, torch.float64, "cpu")
    expanded_keys = []
    expand = _expand_of(w_uk, w_uv)
    scale = (nope + rope) ** -0.5
    out = mla_attention.mla_attention(q, cache, w_uk, w_uv, tables, torch.tensor(context_lens), query_lens, scale,
                                      expand=lambda c_kv: expanded_keys.append(len(c_kv)) or expand(c_kv),
                                      form="expanded")
    assert rel_err(out, reference(q, latents, w_uk, w_uv, query_lens, scale)) < 1e-12
    assert max(expanded_keys) == min(chunk, max(context_lens)) and sum(expanded_keys) == sum(context_lens)


def test_a_chunk_of_keys_is_attended_by_the_queries_that_see_it():
    """_chunk_calls: the queries before a chunk read none of it, those whose own positions it holds read it causal
    lower-right up to the last of them, those after it all of it unmasked; query blocks split the rows."""
    def calls(*args, max_scores=mla_attention.EXPAND_MAX_SCORES):
        return mla_attention._chunk_calls(*args, max_scores)

    # 23 queries at positions 47..69, chunks of 16 keys
    assert calls(23, 47, 0, 16, 4) == [(slice(0, 23), 16, False)]  # keys 0..15: every query, unmasked
    assert calls(23, 47, 32, 16, 4) == [(slice(0, 1), 16, True), (slice(1, 23), 16, False)]  # query 47 its own
    assert calls(23, 47, 48, 16, 4) == [(slice(1, 17), 16, True), (slice(17, 23), 16, False)]
    assert calls(23, 47, 64, 6, 4) == [(slice(17, 23), 6, True)]
    # a fresh prompt of 8 in one chunk, blocks of 3 queries: each block lower-right over the keys up to its last
    assert calls(8, 0, 0, 8, 2, max_scores=2 * 8 * 3) == [(slice(0, 3), 3, True), (slice(3, 6), 6, True),
                                                          (slice(6, 8), 8, True)]


def test_partial_outputs_merge_by_their_log_sum_exps():
    """merge_partial: two halves of the keys attended apart, merged in either order (the first copied, as the first
    chunk's calls are, or merged into an empty running output), give attention over all of them (float64)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in ((5, 2, 6), (9, 2, 6), (9, 2, 4)))
    whole, whole_lse = mla_attention.attend(q, k, v, 0.3, False)
    want = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) * 0.3, dim=-1)
    torch.testing.assert_close(whole, torch.einsum("hqk,khv->qhv", want, v), rtol=1e-12, atol=1e-12)
    for order in ((slice(0, 4), slice(4, 9)), (slice(4, 9), slice(0, 4))):
        for copy_first in (True, False):
            out, lse = torch.zeros(5, 2, 4, dtype=torch.float64), torch.full((5, 2), float("-inf"), dtype=torch.float64)
            for i, keys in enumerate(order):
                part = mla_attention.attend(q, k[keys], v[keys], 0.3, False)
                mla_attention.merge_partial(out, lse, slice(0, 5), *part, first=copy_first and i == 0)
            torch.testing.assert_close(out, whole, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(lse, whole_lse, rtol=1e-12, atol=1e-12)


def test_the_cuda_routing_expands_the_sequences_of_many_queries(monkeypatch):
    """cuda_expanded_sequences: decode rows and short chunks stay absorbed; a sequence of CUDA_EXPAND_MIN_QUERIES
    queries or more expands, however long its context (the expanded form takes it in chunks: no context bound, where
    contexts past 2^20 / num_heads keys stayed absorbed before); a forced form is every sequence's (an empty one
    none); the context lengths are not asked for where no sequence has that many queries (a decode step: reading
    them would wait for the device)."""
    many = mla_attention.CUDA_EXPAND_MIN_QUERIES

    def unread():
        raise AssertionError("read the context lengths")

    route = mla_attention.cuda_expanded_sequences
    # at DeepSeek's shapes, as measured (the constants' comment): V2-Lite's 512-token prompt absorbed, its 2048-token
    # prompt and a 512-query chunk after 4096 expanded; V3's 128-token prompt absorbed, its 512-token prompt expanded;
    # V3's 512-query chunk after 100000 cached tokens and its 32768-token prompt expanded (past 8192 keys)
    assert route([512, 2048, 512], lambda: [512, 2048, 4608], 16) == [1, 2]
    assert route([128, 512, 512, 32768], lambda: [128, 512, 100512, 32768], 128) == [1, 2, 3]
    monkeypatch.setattr(mla_attention, "CUDA_EXPAND_MIN_WORK", 0)  # below: the query count alone
    assert route([1] * 8, unread, 16) == [] and route([1, many - 1, 3], unread, 128) == []
    assert route([1, many, many, many], lambda: [500, many, 4096 + many, 2**20], 16) == [1, 2, 3]
    assert route([1, 0, 5], unread, 16, form="expanded") == [0, 2]
    assert route([many, many], unread, 16, form="absorbed") == []


SPLIT_CASES = {
    # name: (context_lens, query_lens, expanded sequences)
    "decodes-beside-a-long-chunk": ([1, 150, 33, 600], [1, 130, 1, 1], [1]),
    "a-whole-prompt": ([140], [140], [0]),
    "two-long-chunks-and-a-short-one": ([129, 40, 300], [129, 20, 200], [0, 2]),
    "all-absorbed": ([40, 9, 70], [13, 1, 70], []),
}


@pytest.mark.parametrize("case", list(SPLIT_CASES))
def test_a_cuda_step_splits_its_rows_between_the_two_forms(dot_case, case, rel_err, monkeypatch):
    """The CUDA path (cuda_mla_attention: on CPU tensors its kernel in Triton's interpreter; on a GPU, -m gpu,
    through mla_attention) splits a mixed step: the sequences of many queries expanded, the other rows through the
    absorbed kernel, into one output equal to float64's; the split it made is the step's route."""
    device, dtype = dot_case
    monkeypatch.setattr(mla_attention, "CUDA_EXPAND_MIN_WORK", 0)  # (these shapes are small)
    context_lens, query_lens, want_expanded = SPLIT_CASES[case]
    heads, nope, rope, v_dim, rank, block_size = 4, 16, 16, 8, 32, 16
    (q, cache, tables, w_uk, w_uv), latents = make_step(context_lens, query_lens, heads, nope, rope, v_dim, rank,
                                                        block_size, dtype, device)
    scale = (nope + rope) ** -0.5
    ctx = torch.tensor(context_lens, dtype=torch.int32, device=device)
    step, out = {}, torch.full((q.shape[0], heads, nope + rope), float("nan"), dtype=dtype, device=device)
    run = mla_attention.mla_attention if device == "cuda" else mla_attention.cuda_mla_attention
    got = run(q, cache, w_uk, w_uv, tables, ctx, query_lens, scale, kv_scale=1.0, max_context_len=max(context_lens),
              expand=_expand_of(w_uk, w_uv), form=None, index_cache=step, prefill_index=None, out=out,
              host_context_lens=context_lens)
    expanded, absorbed_rows = step[("mla_route", q.shape[0])]
    assert [seq for seq, _, _ in expanded] == want_expanded
    firsts = [sum(query_lens[:seq]) for seq in range(len(query_lens))]
    want = [(firsts[seq], context_lens[seq]) for seq in want_expanded]
    assert [(first, context) for _, first, context in expanded] == want
    if want_expanded:
        absorbed = [row for seq, n in enumerate(query_lens) if seq not in want_expanded
                    for row in range(firsts[seq], firsts[seq] + n)]
        assert absorbed_rows.tolist() == absorbed
    else:
        assert absorbed_rows is None
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(got).all()
    assert rel_err(got.cpu(), reference(q, latents, w_uk, w_uv, query_lens, scale)) < (
        1e-5 if dtype == torch.float32 else 1e-2)


def test_a_graph_step_and_a_model_without_kv_b_stay_absorbed():
    """A whole-forward CUDA graph's step (a prefill_index: query_lens is its captured size) and a call without an
    expand run every row absorbed: no route expands, whatever the query count."""
    many = mla_attention.CUDA_EXPAND_MIN_QUERIES
    ctx = torch.tensor([many], dtype=torch.int32)
    index = attention.PrefillIndex(*(torch.zeros(2, dtype=torch.int32),) * 4, queries_per_block=16,
                                   out=torch.zeros(1))
    for can_expand, prefill_index in ((True, index), (False, None)):
        assert mla_attention._cuda_route([many], ctx, many, 16, can_expand, None, {}, prefill_index,
                                         [many]) == ([], None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads, context_lens, query_lens, host", [
    pytest.param(16, [1, 700, 4096 + 512, 333], [1, 1, 512, 1], True, id="v2-lite-decodes-and-a-chunk-after-4096"),
    pytest.param(16, [2048], [2048], False, id="v2-lite-whole-prompt-device-lengths"),
    pytest.param(128, [1, 1024 + 256, 900], [1, 256, 1], True, id="v3-decodes-and-a-chunk-after-1024"),
])
def test_a_mixed_step_at_deepseek_shapes_on_the_gpu(dtype, heads, context_lens, query_lens, host, rel_err):
    """A mixed step on CUDA at DeepSeek's attention shape (128 + 64 q/k dims, 128 v dims, latent 512 + 64, blocks of
    16; V2-Lite's 16 heads, V3's 128): the long prefill expanded (torch's fused attention, lower-right causal after
    the cached tokens), the decode rows through the absorbed kernel, one output: float64's expanded attention. The
    context lengths given on the host, or read from the device."""
    (q, cache, tables, w_uk, w_uv), latents = make_step(context_lens, query_lens, heads, 128, 64, 128, 512, 16, dtype,
                                                        "cuda")
    scale, step = 192 ** -0.5, {}
    out = mla_attention.mla_attention(q, cache, w_uk, w_uv, tables, torch.tensor(context_lens, dtype=torch.int32,
                                                                                   device="cuda"), query_lens, scale,
                                      max_context_len=max(context_lens), expand=_expand_of(w_uk, w_uv),
                                      index_cache=step, host_context_lens=context_lens if host else None)
    expanded, _ = step[("mla_route", q.shape[0])]
    assert [seq for seq, _, _ in expanded] == [s for s, n in enumerate(query_lens) if n >= 128]
    assert out.shape == (q.shape[0], heads, 128) and torch.isfinite(out).all()
    assert rel_err(out.cpu(), reference(q, latents, w_uk, w_uv, query_lens, scale)) < (
        2e-2 if dtype == torch.bfloat16 else 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads, context_lens, query_lens, chunk, scores", [
    pytest.param(16, [3000, 700], [1000, 1], 1024, 2**28, id="v2-lite-a-chunk-after-2000-in-chunks-of-1024"),
    pytest.param(128, [2500, 1500], [700, 1500], 512, 128 * 512 * 256,
                 id="v3-a-chunk-after-1800-and-a-prompt-in-chunks-of-512-blocks-of-256"),
])
def test_the_expanded_form_in_chunks_of_keys_on_the_gpu(dtype, heads, context_lens, query_lens, chunk, scores,
                                                        monkeypatch, rel_err):
    """The CUDA route of the expanded form at DeepSeek's attention shape (128 + 64 q/k dims, 128 v, latent 512 + 64,
    blocks of 16) with contexts of several chunks (EXPAND_MAX_KEY_HEADS lowered to the chunk times the heads; V3's
    query blocks of 256 in a chunk): torch's memory-efficient kernel per chunk and block, unmasked and lower-right
    (custom_mask_type 2), its log-sum-exps merging the chunks (V2-Lite's beside a decode row through the absorbed
    kernel): float64's plain attention over the whole contexts."""
    monkeypatch.setattr(mla_attention, "EXPAND_MAX_KEY_HEADS", chunk * heads)
    monkeypatch.setattr(mla_attention, "CUDA_EXPAND_MAX_SCORES", scores)
    (q, cache, tables, w_uk, w_uv), latents = make_step(context_lens, query_lens, heads, 128, 64, 128, 512, 16, dtype,
                                                        "cuda")
    scale, step, calls = 192 ** -0.5, {}, []
    attend = mla_attention.attend
    monkeypatch.setattr(mla_attention, "attend", lambda q, k, *args: calls.append(k.shape[0]) or attend(q, k, *args))
    out = mla_attention.mla_attention(q, cache, w_uk, w_uv, tables, torch.tensor(context_lens, dtype=torch.int32,
                                                                                   device="cuda"), query_lens, scale,
                                      max_context_len=max(context_lens), expand=_expand_of(w_uk, w_uv),
                                      index_cache=step, host_context_lens=context_lens)
    expanded, _ = step[("mla_route", q.shape[0])]
    assert [seq for seq, _, _ in expanded] == [s for s, n in enumerate(query_lens) if n >= 128]
    assert max(calls) == chunk and len(calls) > len(expanded) * 2
    assert out.shape == (q.shape[0], heads, 128) and torch.isfinite(out).all()
    assert rel_err(out.cpu(), reference(q, latents, w_uk, w_uv, query_lens, scale)) < (
        2e-2 if dtype == torch.bfloat16 else 1e-4)
