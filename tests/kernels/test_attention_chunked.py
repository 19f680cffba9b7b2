"""Chunked local attention (Llama 4's rope layers, `attention_chunk_size` C): a query at position p sees the keys
[floor(p / C) * C, p]. The Triton decode kernel (unsplit, split with either merge, rotating its own keys), the prefill
kernel (chunked prefill straddling chunk boundaries, from a PrefillIndex too) and the torch path against that rule
written out in float64."""

import pytest
import torch

from llmc.kernels import attention
from tests.kernels.test_attention import _indexed_prefill, _rotating_decode_step, lens, make_batch, split_qkv

CASES = {
    # name: (context_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, chunk, partitions)
    # a prompt chunk after 27 cached tokens crossing 32, a decode row inside its first chunk, a prompt of 5 chunks
    "prefill-straddling": ([40, 9, 70], [13, 1, 70], 6, 2, 24, 8, 16, None),
    # C not a multiple of the cache's blocks or the key tiles; a chunk of prefill from mid-chunk, a decode past 4 chunks
    "unaligned": ([61, 50], [29, 1], 4, 2, 16, 16, 12, None),
    "decode-far-past": ([1100, 90, 33], [1, 1, 1], 4, 1, 16, 16, 100, None),
    # the chunk's start leaves the first partitions empty (1100: keys from 1024 on)
    "partitioned-decode": ([1100, 700, 256], [1, 1, 1], 2, 1, 16, 16, 256, 3),
    "partitioned-mixed": ([300, 9, 70, 1], [1, 9, 1, 1], 4, 2, 16, 16, 32, 5),
}


def chunked_reference(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale, chunk):
    """Each query row's softmax over its keys [floor(p / chunk) * chunk, p], in float64 (chunk None: [0, p])."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = q.shape[1] // num_kv_heads
    out, row = torch.zeros(q.shape, dtype=torch.float64), 0
    for seq, (context_len, query_len) in enumerate(zip(context_lens, query_lens)):
        slots = (block_tables[seq].cpu().long()[:, None] * block_size + torch.arange(block_size)).flatten()[:context_len]
        k = k_cache.cpu().flatten(0, 1)[slots].double()  # [context, kv heads, d]
        v = v_cache.cpu().flatten(0, 1)[slots].double()
        for p in range(context_len - query_len, context_len):
            first = 0 if chunk is None else p // chunk * chunk
            q_row = q[row].cpu().double().view(num_kv_heads, group, head_dim)  # head h reads KV head h // group
            scores = torch.einsum("kgd,tkd->kgt", q_row, k[first : p + 1]) * scale
            out[row] = torch.einsum("kgt,tkd->kgd", torch.softmax(scores, dim=-1), v[first : p + 1]).flatten(0, 1)
            row += 1
    return out


@pytest.mark.parametrize("merge_in_kernel_min_pairs", [1, 10**9])  # merged in the decode kernel; by the second
@pytest.mark.parametrize("case", list(CASES))
def test_kernels_attend_within_the_chunk(dot_case, rel_err, monkeypatch, case, merge_in_kernel_min_pairs) -> None:
    """Every row against the rule in float64 (every cache slot no sequence owns is NaN: nothing outside the context
    is read); the torch path in float64 too; causal attention is far from it (the chunk bound is exercised)."""
    from llmc.kernels.attention_triton import paged_attention

    device, dtype = dot_case
    context_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, chunk, partitions = CASES[case]
    if merge_in_kernel_min_pairs > 1 and not partitions:
        pytest.skip("no split: no merge")
    monkeypatch.setattr(attention, "MERGE_IN_KERNEL_MIN_PAIRS", merge_in_kernel_min_pairs)
    q, k_cache, v_cache, block_tables = make_batch(context_lens, query_lens, num_heads, num_kv_heads, head_dim,
                                                   block_size, dtype, device)
    scale = head_dim**-0.5
    out = paged_attention(q, k_cache, v_cache, block_tables, lens(context_lens, device), query_lens, scale, None,
                          max(context_lens), partitions, attention_chunk_size=chunk)
    expected = chunked_reference(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale, chunk)
    assert torch.isfinite(out).all()
    assert rel_err(out.cpu(), expected) < (1e-6 if dtype == torch.float32 else 1e-2)
    as64 = lambda t: t.cpu().double()  # noqa: E731
    torch_out = attention.paged_attention(as64(q), as64(k_cache), as64(v_cache), block_tables.cpu(),
                                          lens(context_lens, "cpu"), query_lens, scale, attention_chunk_size=chunk)
    assert rel_err(torch_out, expected) < 1e-6  # (the torch path scores in float32)
    causal = chunked_reference(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale, None)
    assert rel_err(causal, expected) > 0.05


def test_the_decode_kernel_rotating_its_keys_attends_within_the_chunk(dot_case, rel_err) -> None:
    """rotate_write_and_attend's decode-only path (the rotary and the KV write in the decode kernel, split in 11
    partitions, merged in the kernel) with a chunk of 100: the bits of rotate_and_write_kv then paged_attention, and the rule's result."""
    from llmc.kernels import attention_triton

    device, dtype = dot_case
    qkv, sizes, k_cache, v_cache, scales, block_tables, positions, cos_sin, slots, ctx = _rotating_decode_step(
        "window", dtype, device)  # contexts 700 and 90, 4 heads over 1 KV head of 24
    scale, seqs, chunk = 24**-0.5, [1, 1], 100
    q, k, v = split_qkv(qkv.clone(), sizes, 24)
    k_fused, v_fused = k_cache.clone(), v_cache.clone()
    fused = attention_triton.paged_attention(q, k_fused, v_fused, block_tables, ctx, seqs, scale, None, 2048, 11,
                                             rotary=(k, v, positions, cos_sin, slots), attention_chunk_size=chunk)
    k_c, v_c = k_cache.clone(), v_cache.clone()
    q = attention_triton.rotate_and_write_kv(q, k, v, positions, cos_sin, k_c, v_c, slots, *scales)
    two_kernels = attention_triton.paged_attention(q, k_c, v_c, block_tables, ctx, seqs, scale, None, 2048, 11,
                                                   attention_chunk_size=chunk)
    assert torch.equal(fused, two_kernels)
    expected = chunked_reference(q, k_c, v_c, block_tables, [700, 90], seqs, scale, chunk)
    assert rel_err(fused.cpu(), expected) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_the_indexed_prefill_attends_within_the_chunk(dot_case, rel_err) -> None:
    """The prefill kernel given a mixed step by a PrefillIndex alone (FULL CUDA graphs of mixed steps: a chunk after
    cached tokens, a decode row, a whole prompt, padding) with chunks of 16: against the rule in float64."""
    out, (q, k_cache, v_cache, block_tables, context_lens, query_lens, _) = _indexed_prefill(
        dot_case, window=None, attention_chunk_size=16)
    expected = chunked_reference(q, k_cache, v_cache, block_tables, context_lens, query_lens, q.shape[-1]**-0.5, 16)
    assert rel_err(out.cpu(), expected) < (1e-6 if dot_case[1] == torch.float32 else 1e-2)


def test_a_window_and_a_chunk_together_are_refused() -> None:
    q, k_cache, v_cache, block_tables = make_batch([5], [5], 2, 1, 16, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="sliding_window or in chunks"):
        attention.paged_attention(q, k_cache, v_cache, block_tables, lens([5], "cpu"), [5], 0.25, 4,
                                  attention_chunk_size=4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_public_paged_attention_on_cuda_llama4_shapes(rel_err, dtype) -> None:
    """Scout's attention (40 heads over 8 KV heads of 128, chunks of 8192) through kernels.attention: decodes 2 and
    0 chunks past the first and 1 key into its second, a prefill of 300 crossing 8192, against the rule in float64."""
    context_lens, query_lens, chunk = [20000, 1, 8193, 8300], [1, 1, 1, 300], 8192
    q, k_cache, v_cache, block_tables = make_batch(context_lens, query_lens, 40, 8, 128, 16, dtype, "cuda")
    scale = 128**-0.5
    out = attention.paged_attention(q, k_cache, v_cache, block_tables, lens(context_lens, "cuda"), query_lens, scale,
                                    attention_chunk_size=chunk)
    expected = chunked_reference(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale, chunk)
    assert torch.isfinite(out).all() and rel_err(out.cpu(), expected) < 1e-2
