"""Paged attention (decode, prefill / chunked prefill, GQA, sliding window, logit soft-capping) and the
KV-cache write with the rotary embedding of q and k before it."""

import dataclasses
import math

import pytest
import torch

from llmc.kernels import attention, rotary


def make_batch(context_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed=0):
    """q, caches and block tables of a step; every cache slot no sequence owns holds NaN, block 0
    (the padding of the block tables) too."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(n / block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_tables = torch.zeros(len(context_lens), max(blocks_per_seq) + 1, dtype=torch.int32)  # padded with 0
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    for seq, (context_len, n_blocks) in enumerate(zip(context_lens, blocks_per_seq)):
        blocks = torch.tensor([order.pop() for _ in range(n_blocks)], dtype=torch.int32)
        block_tables[seq, :n_blocks] = blocks
        slots = (blocks.long()[:, None] * block_size + torch.arange(block_size)).flatten()[:context_len]
        k = torch.randn(context_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(context_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        attention.write_kv_cache(k, v, k_cache, v_cache, slots)  # CPU tensors: the torch path
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    return [t.to(device) for t in (q, k_cache, v_cache, block_tables)]


def expected_attention(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale, window, softcap=None):
    """The torch path in float64 on the CPU."""
    as64 = lambda t: t.cpu().double()  # noqa: E731
    return attention.paged_attention(
        as64(q), as64(k_cache), as64(v_cache), block_tables.cpu(), lens(context_lens, "cpu"), query_lens, scale, window,
        softcap=softcap,
    )


def lens(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


CASES = {
    # name: (context_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, window, partitions)
    "decode-gqa": ([1, 17, 100], [1, 1, 1], 8, 2, 32, 16, None, None),
    "mixed-chunked": ([40, 9, 70], [13, 1, 70], 6, 2, 24, 8, None, None),
    "window": ([40, 90, 33], [13, 1, 33], 4, 4, 16, 16, 20, None),
    "partitioned-decode": ([1100, 5], [1, 1], 4, 1, 16, 32, None, 3),
    "long-unpartitioned-decode": ([700, 3], [1, 1], 4, 2, 16, 16, None, 1),  # one program, 11 key tiles
    "partitioned-window": ([1100, 700], [1, 1], 2, 1, 16, 16, 300, 3),
    # decode rows between prefill rows, split (the merge kernel finds each row's sequence and context)
    "partitioned-mixed": ([300, 9, 70, 1], [1, 9, 1, 1], 4, 2, 16, 16, None, 5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_kernels_match_float64(dot_case, rel_err, case) -> None:
    from llmc.kernels.attention_triton import paged_attention

    device, dtype = dot_case
    context_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, window, partitions = CASES[case]
    q, k_cache, v_cache, block_tables = make_batch(
        context_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device
    )
    scale = head_dim**-0.5
    out = paged_attention(q, k_cache, v_cache, block_tables, lens(context_lens, device), query_lens, scale, window,
                          max(context_lens), partitions)
    expected = expected_attention(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale, window)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()  # no NaN slot leaked in, every row written
    assert rel_err(out.cpu(), expected) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_layers_of_a_step_share_its_index_tensors(dot_case, rel_err) -> None:
    """The per-sequence index tensors of a mixed step are made by the first layer and reused by the
    next (ForwardBatch.kernel_cache): each layer still matches float64."""
    from llmc.kernels.attention_triton import paged_attention

    device, dtype = dot_case
    context_lens, query_lens = [40, 9, 70], [13, 1, 70]
    cache = {}
    for layer in range(2):
        q, k_cache, v_cache, block_tables = make_batch(context_lens, query_lens, 6, 2, 24, 8, dtype, device, seed=layer)
        out = paged_attention(q, k_cache, v_cache, block_tables, lens(context_lens, device), query_lens, 24**-0.5,
                              None, max(context_lens), index_cache=cache)
        expected = expected_attention(q, k_cache, v_cache, block_tables, context_lens, query_lens, 24**-0.5, None)
        assert rel_err(out.cpu(), expected) < (1e-6 if dtype == torch.float32 else 1e-2)
        if layer == 0:
            made = dict(cache)
    assert {key for key, _ in made} >= {"decode_rows", "decode_seqs", "query_lens", "first_rows"}
    assert cache.keys() == made.keys() and all(cache[k] is made[k] for k in made)  # nothing made again
    assert made[("query_lens", q.device)].tolist() == query_lens


@pytest.mark.parametrize("window", [None, 20])
def test_prefill_index_runs_a_padded_mixed_step_from_device_tensors(dot_case, rel_err, window) -> None:
    """A mixed step (a prompt chunk after a prefix, decode rows, a fresh prompt) given to the prefill
    kernel by a PrefillIndex alone, as a CUDA graph of 64 tokens in at most 6 sequences holds it:
    unused blocks point at the padding sequence, unused sequences hold stale values. Each real row
    matches float64; the padding rows (no block covers them) keep what the output buffer held."""
    from llmc.kernels.attention_triton import paged_attention

    device, dtype = dot_case
    context_lens, query_lens = [40, 17, 9, 33, 1], [13, 1, 1, 33, 1]
    num_heads, num_kv_heads, head_dim, block_size, size, max_seqs = 8, 2, 16, 8, 64, 6
    q, k_cache, v_cache, block_tables = make_batch(context_lens, query_lens, num_heads, num_kv_heads, head_dim,
                                                   block_size, dtype, device)
    n, per_block = q.shape[0], attention.prefill_queries_per_block(num_heads // num_kv_heads)
    assert per_block == 16
    blocks = attention.prefill_blocks(query_lens, per_block)
    num_blocks = attention.max_prefill_blocks(size, max_seqs, per_block)
    assert len(blocks) == 7 and num_blocks == 10
    pad = max_seqs  # the padding sequence: context 0, no query
    index = attention.PrefillIndex(  # sequence 5 unused: a stale context and first row, no query
        query_lens=lens(query_lens + [0, 0], device),
        first_rows=lens([0, 13, 14, 15, 48, 7, 0], device),
        block_seqs=lens([seq for seq, _ in blocks] + [pad] * (num_blocks - len(blocks)), device),
        block_starts=lens([start for _, start in blocks] + [0] * (num_blocks - len(blocks)), device),
        queries_per_block=per_block,
        out=torch.full((size, num_heads, head_dim), 5.0, dtype=dtype, device=device),
    )
    ctx_all = lens(context_lens + [9, 0], device)
    tables = torch.cat([block_tables, block_tables[:2]])  # rows 5 and 6: never read
    q_padded = torch.cat([q, torch.full((size - n, num_heads, head_dim), float("nan"), dtype=dtype, device=device)])
    out = paged_attention(q_padded, k_cache, v_cache, tables, ctx_all, [size], head_dim**-0.5, window,
                          prefill_index=index)
    expected = expected_attention(q, k_cache, v_cache, block_tables, context_lens, query_lens, head_dim**-0.5, window)
    assert out.data_ptr() == index.out.data_ptr()
    assert rel_err(out[:n].cpu(), expected) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.equal(out[n:].cpu(), torch.full((size - n, num_heads, head_dim), 5.0, dtype=dtype))
    # the torch path (CPU tensors) reads the same index: the same rows, the padding rows untouched
    cpu_index = dataclasses.replace(index, **{f: getattr(index, f).cpu() for f in
                                              ("query_lens", "first_rows", "block_seqs", "block_starts")},
                                    out=torch.full((size, num_heads, head_dim), 5.0, dtype=torch.float64))
    as64 = lambda t: t.cpu().double()  # noqa: E731
    torch_out = attention.paged_attention(as64(q_padded), as64(k_cache), as64(v_cache), tables.cpu(), ctx_all.cpu(),
                                          [size], head_dim**-0.5, window, prefill_index=cpu_index)
    assert torch.equal(torch_out[:n], expected) and torch.equal(torch_out[n:], cpu_index.out[n:])


def test_prefill_index_skips_a_sequence_with_no_query_on_either_path() -> None:
    """A sequence of 0 queries between two others (the engine schedules none, a caller may): the
    Triton kernel (interpreter) and the torch path both give the other sequences' rows."""
    from llmc.kernels.attention_triton import paged_attention

    context_lens, query_lens = [5, 9, 4], [3, 0, 2]
    q, k_cache, v_cache, block_tables = make_batch(context_lens, query_lens, 4, 2, 16, 4, torch.float32, "cpu")
    blocks = attention.prefill_blocks(query_lens, attention.prefill_queries_per_block(2))
    index = lambda: attention.PrefillIndex(  # noqa: E731
        query_lens=lens(query_lens + [0], "cpu"), first_rows=lens([0, 3, 3, 0], "cpu"),
        block_seqs=lens([s for s, _ in blocks] + [3], "cpu"), block_starts=lens([b for _, b in blocks] + [0], "cpu"),
        queries_per_block=attention.prefill_queries_per_block(2), out=torch.full((6, 4, 16), 9.0))
    tables, ctx = torch.cat([block_tables, block_tables[:1]]), lens(context_lens + [0], "cpu")
    expected = expected_attention(q, k_cache, v_cache, block_tables, context_lens, query_lens, 0.25, None).float()
    q6 = torch.cat([q, torch.zeros(1, 4, 16)])
    for out in (paged_attention(q6, k_cache, v_cache, tables, ctx, [6], 0.25, prefill_index=index()),
                attention.paged_attention(q6, k_cache, v_cache, tables, ctx, [6], 0.25, prefill_index=index())):
        torch.testing.assert_close(out[:5], expected, atol=1e-5, rtol=1e-5)
        assert out[5].eq(9.0).all()


def test_decode_split_spreads_few_sequences_over_the_sms() -> None:
    """(partitions, keys per partition) by the rule in decode_split's docstring, worked by hand for
    132 SMs (2 programs per SM: 264)."""
    split = attention.decode_split
    assert split(264, 131072, 132) == (1, 131072)  # the pairs fill the GPU: never split
    assert split(8, 2048, 132) == (32, 64)  # one 8-KV-head sequence: 64-key partitions (8 × 8 < 264)
    assert split(64, 2048, 132) == (32, 64)  # 8 sequences: 64 × 4 = 256 < 264, so still 64 keys
    assert split(128, 2048, 132) == (16, 128)  # 16 sequences: 128 × 4 = 512 ≥ 264
    assert split(256, 2048, 132) == (8, 256)  # 32 sequences: 256 × 2 = 512 ≥ 264
    assert split(8, 8192, 132) == (64, 128)  # 64-key partitions would be 128 of them (MAX_PARTITIONS 64)
    assert split(8, 131072, 132) == (256, 512)  # a long bound: PARTITION_SIZE keys, as many as it takes
    assert split(8, 64, 132) == (1, 64)  # one 64-key partition holds every key: not split
    assert split(2, 4096, 16) == (64, 64)


@pytest.mark.parametrize("merge_in_kernel_min_pairs", [1, 10**9])  # merged in the decode kernel; by the second
def test_empty_partitions_are_never_read(dot_case, rel_err, monkeypatch, merge_in_kernel_min_pairs) -> None:
    """Partitions past a context (or before a sliding window) store nothing: with the partial buffers
    full of NaN, the split decode (64-key partitions under a 4096-key bound, most of them empty) still
    matches float64."""
    from llmc.kernels import attention_triton

    device, dtype = dot_case
    context_lens, window = [300, 5, 200], 150
    q, k_cache, v_cache, block_tables = make_batch(context_lens, [1] * 3, 4, 2, 16, 16, dtype, device)
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    monkeypatch.setattr(attention_triton, "_choose_split",
                        lambda num_programs, max_context, device_: attention.decode_split(num_programs, max_context, 132))
    monkeypatch.setattr(attention, "MERGE_IN_KERNEL_MIN_PAIRS", merge_in_kernel_min_pairs)
    for w in (None, window):
        out = attention_triton.paged_attention(q, k_cache, v_cache, block_tables, lens(context_lens, device), [1] * 3,
                                               16**-0.5, w, 4096)
        expected = expected_attention(q, k_cache, v_cache, block_tables, context_lens, [1] * 3, 16**-0.5, w)
        assert torch.isfinite(out).all()
        assert rel_err(out.cpu(), expected) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_eager_decode_cases_reach_every_decode_variant(monkeypatch) -> None:
    """Start-up's eager steps: not split, split with the second merge kernel (below
    MERGE_IN_KERNEL_MIN_PAIRS pairs), split with the merge in the kernel. With the threshold at one
    pair (session 20) every split step merges in the kernel: one split case."""
    assert attention.decode_split(8, 64, 132)[0] == 1 < attention.decode_split(8, 2048, 132)[0]
    assert attention.MERGE_IN_KERNEL_MIN_PAIRS == 1
    assert attention.eager_decode_cases(8, 2048, 132) == [(1, 64), (1, 2048)]
    monkeypatch.setattr(attention, "MERGE_IN_KERNEL_MIN_PAIRS", 32)  # 8 pairs: the second kernel; 4 rows: in it
    assert attention.eager_decode_cases(8, 2048, 132) == [(1, 64), (1, 2048), (4, 2048)]
    monkeypatch.undo()
    assert attention.eager_decode_cases(8, 64, 132) == [(1, 64)]  # max_model_len 64: never split
    assert attention.eager_decode_cases(40, 4096, 132) == [(1, 64), (1, 4096)]  # one row is 40 pairs already
    assert attention.eager_decode_cases(8, 4096, 16) == [(1, 64), (1, 4096)]  # 4 rows fill 16 SMs: not split


@pytest.mark.parametrize("window", [None, 300])
def test_decode_is_the_same_whatever_the_context_bound(dot_case, rel_err, monkeypatch, window) -> None:
    """A CUDA graph launches decode with max_context_len = max_model_len, an eager step with the batch's
    longest context: the keys are split at the same boundaries either way (the extra partitions are
    empty, and the merges skip them). Merged by the decode kernel's last non-empty partition (from
    MERGE_IN_KERNEL_MIN_PAIRS pairs, here forced) the output has the same bits, the semaphores are
    back at zero after each call; merged by the second kernel (fewer pairs, or no semaphores inside
    a graph capture) the same values (its tree sum gives other bits)."""
    from llmc.kernels import attention_triton

    device, dtype = dot_case
    context_lens = [1100, 5, 40]
    q, k_cache, v_cache, block_tables = make_batch(context_lens, [1] * 3, 4, 2, 16, 16, dtype, device)
    ctx, scale = lens(context_lens, device), 16**-0.5
    run = lambda bound: attention_triton.paged_attention(  # noqa: E731
        q, k_cache, v_cache, block_tables, ctx, [1] * 3, scale, window, bound)
    unsplit_short = attention_triton.paged_attention(q[1:], k_cache, v_cache, block_tables[1:], ctx[1:], [1] * 2,
                                                     scale, window, 40)
    # as on an H100: 6 pairs split into 64-key partitions at both bounds (18 or 64 of them, most empty)
    monkeypatch.setattr(attention_triton, "_choose_split",
                        lambda num_programs, max_context, device_: attention.decode_split(num_programs, max_context, 132))
    assert attention.decode_split(6, 1100, 132) == (18, 64) and attention.decode_split(6, 4096, 132) == (64, 64)
    counters = torch.zeros(64, dtype=torch.int32, device=device)
    monkeypatch.setattr(attention_triton, "tile_counters", lambda device_, num_tiles: counters[:num_tiles])
    monkeypatch.setattr(attention, "MERGE_IN_KERNEL_MIN_PAIRS", 1)
    eager, graph = run(max(context_lens)), run(4096)
    assert counters.eq(0).all()  # every (sequence, KV head)'s semaphore back at zero for the next call
    assert torch.equal(eager, graph)
    assert torch.equal(graph[1:], unsplit_short)
    # the second kernel sums the partitions as a tree, not in order: other bits, the same values
    same = lambda a, b: rel_err(a, b) < (1e-6 if dtype == torch.float32 else 1e-2)  # noqa: E731
    for merge_in_kernel_min_pairs in (7, 1):  # 6 pairs: the second kernel; then none to be had in a capture
        monkeypatch.setattr(attention, "MERGE_IN_KERNEL_MIN_PAIRS", merge_in_kernel_min_pairs)
        monkeypatch.setattr(attention_triton, "tile_counters", lambda device_, num_tiles: None)
        assert same(run(4096), graph)
    expected = expected_attention(q, k_cache, v_cache, block_tables, context_lens, [1] * 3, scale, window)
    assert rel_err(graph.cpu(), expected) < (1e-6 if dtype == torch.float32 else 1e-2)


def rotary_step(num_tokens, num_heads, num_kv_heads, head_dim, dtype, seed=0):
    """A fused qkv output [num_tokens, (heads + 2 kv heads) * head_dim], its q, k, v views (strided,
    as the model splits them), a cos/sin table of 64 positions and each token's position."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = torch.randn(num_tokens, sum(sizes), generator=gen).to(dtype)
    angles = torch.rand(64, head_dim // 2, generator=gen) * 6
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    positions = torch.randint(0, 64, (num_tokens,), generator=gen)
    return qkv, sizes, cos_sin, positions


def split_qkv(qkv, sizes, head_dim):
    return [t.view(qkv.shape[0], -1, head_dim) for t in qkv.split(sizes, dim=-1)]


@pytest.mark.parametrize("into_buffer", [False, True])
@pytest.mark.parametrize(("num_tokens", "head_dim"), [(1, 16), (7, 24)])
def test_rotate_and_write_kv_kernel_matches_torch(elementwise_case, num_tokens, head_dim, into_buffer) -> None:
    """One kernel: q rotated in place (or into q_out, the piecewise graphs' static buffer, q itself
    untouched), rotated k and v at their slots, as kernels.rotary's torch rotation followed by the
    torch write; k and v themselves and every other slot untouched."""
    from llmc.kernels.attention_triton import rotate_and_write_kv

    device, dtype = elementwise_case
    num_heads, num_kv_heads, num_blocks, block_size = 4, 2, 5, 4
    qkv, sizes, cos_sin, positions = rotary_step(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn_like(k_cache)
    q, k, v = split_qkv(qkv, sizes, head_dim)
    expected_q, expected_k = rotary.apply_rotary(q, k, positions, cos_sin)
    expected_k_cache, expected_v_cache = k_cache.clone(), v_cache.clone()
    attention.write_kv_cache(expected_k, v, expected_k_cache, expected_v_cache, slots)
    qkv_dev, k_cache, v_cache = qkv.to(device), k_cache.to(device), v_cache.to(device)
    q_dev, k_dev, v_dev = split_qkv(qkv_dev, sizes, head_dim)
    buffer = torch.full((num_tokens + 3, num_heads, head_dim), 9.0, dtype=dtype, device=device)
    out = rotate_and_write_kv(q_dev, k_dev, v_dev, positions.to(device), cos_sin.to(device), k_cache, v_cache,
                              slots.to(device), q_out=buffer[:num_tokens] if into_buffer else None)
    assert out.data_ptr() == (buffer if into_buffer else q_dev).data_ptr()
    assert torch.equal(buffer[num_tokens:].cpu(), torch.full((3, num_heads, head_dim), 9.0, dtype=dtype))
    untouched = qkv if into_buffer else qkv[:, sizes[0]:]
    assert torch.equal(qkv_dev[:, -untouched.shape[1]:].cpu(), untouched)  # k and v (and q, into q_out) not written
    assert torch.equal(v_cache.cpu(), expected_v_cache)
    if device == "cpu" and dtype == torch.float32:
        assert torch.equal(out, expected_q) and torch.equal(k_cache, expected_k_cache)
    else:  # a GPU fuses x1 * cos - x2 * sin into an FMA, the interpreter truncates float32 -> 16-bit
        # casts (conftest): one rounding step of the dtype apart
        tolerance = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
        torch.testing.assert_close(out.cpu().float(), expected_q.float(), rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(k_cache.cpu().float(), expected_k_cache.float(), rtol=tolerance, atol=tolerance)


def test_an_identity_table_leaves_q_and_k_as_they_are(elementwise_case) -> None:
    """A table of cos 1, sin 0 (SmolLM3's NoPE layers: runtime/models/decoder.identity_table): the kernel's q and
    cached k are the unrotated ones bit for bit in every dtype (x * 1 - y * 0 is x, fused into an FMA or not), at
    every position."""
    from llmc.kernels.attention_triton import rotate_and_write_kv

    device, dtype = elementwise_case
    num_tokens, head_dim, num_blocks, block_size = 7, 16, 4, 4
    qkv, sizes, _, positions = rotary_step(num_tokens, 4, 2, head_dim, dtype)
    identity = torch.cat((torch.ones(64, head_dim // 2), torch.zeros(64, head_dim // 2)), dim=-1)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    k_cache, v_cache = (torch.zeros(num_blocks, block_size, 2, head_dim, dtype=dtype, device=device) for _ in range(2))
    q, k, v = split_qkv(qkv.to(device), sizes, head_dim)
    want_q, want_k = q.clone(), k.clone()
    out = rotate_and_write_kv(q, k, v, positions.to(device), identity.to(device), k_cache, v_cache, slots.to(device))
    assert torch.equal(out.cpu(), want_q.cpu())
    assert torch.equal(k_cache.flatten(0, 1)[slots.to(device)].cpu(), want_k.cpu())


# name: (context_lens, num_heads, num_kv_heads, head_dim, window, partitions, merge_in_kernel_min_pairs, fp8 cache)
ROTATE_CASES = {
    "unsplit-gqa": ([1, 17, 100], 8, 2, 32, None, None, 32, False),
    "split-second-kernel": ([1100, 5, 64], 4, 2, 16, None, 18, 10**9, False),
    "split-merged-in-kernel": ([1100, 5, 65], 4, 2, 16, None, 18, 1, False),
    "window": ([700, 90], 4, 1, 24, 300, 11, 10**9, False),
    "fp8-cache": ([300, 1, 33], 4, 2, 16, None, 5, 10**9, True),
}


def _rotating_decode_step(case: str, dtype: torch.dtype, device: str):
    """A decode step of ROTATE_CASES[case] whose rotary and KV write the decode kernel may do (rotate_write_and_attend):
    (qkv, sizes, k_cache, v_cache (FP8 with scales 0.02 / 0.03 where the case says), scales, block_tables, positions,
    cos_sin, slots, context lengths on the device), on `device`."""
    context_lens, num_heads, num_kv_heads, head_dim, _, _, _, fp8 = ROTATE_CASES[case]
    _, k_cache, v_cache, block_tables = make_batch(context_lens, [1] * len(context_lens), num_heads, num_kv_heads,
                                                   head_dim, 16, dtype, "cpu")
    scales = (0.02, 0.03) if fp8 else (1.0, 1.0)
    if fp8:
        k_cache = attention.quantize_kv(k_cache.nan_to_num(0.0), scales[0], torch.float8_e4m3fn)
        v_cache = attention.quantize_kv(v_cache.nan_to_num(0.0), scales[1], torch.float8_e4m3fn)
    qkv, sizes, _, _ = rotary_step(len(context_lens), num_heads, num_kv_heads, head_dim, dtype)
    angles = torch.rand(2048, head_dim // 2, generator=torch.Generator().manual_seed(1)) * 6
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1).to(device)
    positions = lens(context_lens, device).long() - 1  # the new token is the context's last
    slots = torch.tensor([int(block_tables[i, (n - 1) // 16]) * 16 + (n - 1) % 16 for i, n in enumerate(context_lens)],
                         device=device)
    return (qkv.to(device), sizes, k_cache.to(device), v_cache.to(device), scales, block_tables.to(device), positions,
            cos_sin, slots, lens(context_lens, device))


@pytest.mark.parametrize("case", list(ROTATE_CASES))
def test_decode_step_rotates_and_writes_its_keys_in_the_decode_kernel(dot_case, monkeypatch, case) -> None:
    """A decode step's rotary embedding and KV write inside the decode kernel (rotate_write_and_attend
    on CUDA) give the same bits as rotate_and_write_kv then paged_attention: the output, both caches
    (the new keys and values at their slots, nothing else touched); q and k are left as they were.
    Partitioned or not, merged by the second kernel or in the decode kernel, a sliding window, an
    FP8 cache."""
    from llmc.kernels import attention_triton

    device, dtype = dot_case
    context_lens, _, _, head_dim, window, partitions, min_pairs, _ = ROTATE_CASES[case]
    monkeypatch.setattr(attention, "MERGE_IN_KERNEL_MIN_PAIRS", min_pairs)
    qkv, sizes, k_cache, v_cache, scales, block_tables, positions, cos_sin, slots, ctx = _rotating_decode_step(
        case, dtype, device)
    scale = head_dim**-0.5

    def step(rotate_in_decode: bool):
        qkv_copy, k_c, v_c = qkv.clone(), k_cache.clone(), v_cache.clone()
        q, k, v = split_qkv(qkv_copy, sizes, head_dim)
        common = dict(num_partitions=partitions, k_scale=scales[0], v_scale=scales[1])
        if rotate_in_decode:
            out = attention_triton.paged_attention(q, k_c, v_c, block_tables, ctx, [1] * len(context_lens), scale,
                                                   window, 2048, rotary=(k, v, positions, cos_sin, slots), **common)
        else:
            q = attention_triton.rotate_and_write_kv(q, k, v, positions, cos_sin, k_c, v_c, slots, *scales)
            out = attention_triton.paged_attention(q, k_c, v_c, block_tables, ctx, [1] * len(context_lens), scale,
                                                   window, 2048, **common)
        return out, k_c, v_c, qkv_copy

    fused, two_kernels = step(True), step(False)
    as_bits = lambda t: t.view(torch.uint8)  # noqa: E731  (unwritten slots hold NaN)
    assert torch.equal(fused[0], two_kernels[0])
    assert torch.equal(as_bits(fused[1]), as_bits(two_kernels[1])) and torch.equal(as_bits(fused[2]), as_bits(two_kernels[2]))
    assert not torch.equal(as_bits(fused[1]), as_bits(k_cache))  # the new keys were written
    assert torch.equal(fused[3], qkv)  # q, k, v untouched
    with pytest.raises(ValueError, match="decode-only step"):
        q, k, v = split_qkv(qkv.clone(), sizes, head_dim)
        attention_triton.paged_attention(q, k_cache.clone(), v_cache.clone(), block_tables, ctx,
                                         [1] * (len(context_lens) - 1) + [2], scale, window, 2048,
                                         rotary=(k, v, positions, cos_sin, slots))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_public_paged_attention_on_cuda_llama_shapes(rel_err, dtype) -> None:
    context_lens, query_lens = [3000, 1, 517, 64, 2048], [1, 1, 200, 64, 1]
    q, k_cache, v_cache, block_tables = make_batch(context_lens, query_lens, 32, 8, 128, 16, dtype, "cuda")
    scale = 128**-0.5
    out = attention.paged_attention(q, k_cache, v_cache, block_tables, lens(context_lens, "cuda"), query_lens, scale)
    expected = expected_attention(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale, None)
    assert torch.isfinite(out).all() and rel_err(out.cpu(), expected) < 1e-2


FP8_KV = [pytest.param(torch.float8_e4m3fn, id="e4m3"), pytest.param(torch.float8_e5m2, id="e5m2")]


@pytest.mark.parametrize("kv_dtype", FP8_KV)
@pytest.mark.parametrize("case", ["decode-gqa", "mixed-chunked", "partitioned-window"])
def test_paged_attention_kernels_read_fp8_kv(dot_case, rel_err, kv_dtype, case) -> None:
    """FP8 K/V widened in registers, the scales folded in: against float64 attention over the
    dequantized cache (the same FP8 values, so only the kernel's own rounding is left)."""
    from llmc.kernels.attention_triton import paged_attention

    device, dtype = dot_case
    context_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, window, partitions = CASES[case]
    q, k_cache, v_cache, block_tables = make_batch(
        context_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32, "cpu"
    )
    k_scale, v_scale = 0.37, 2.5  # values of order 1 land in the FP8 grid's middle either way
    k8, v8 = attention.quantize_kv(k_cache, k_scale, kv_dtype), attention.quantize_kv(v_cache, v_scale, kv_dtype)
    scale = head_dim**-0.5
    out = paged_attention(q.to(device, dtype), k8.to(device), v8.to(device), block_tables.to(device),
                          lens(context_lens, device), query_lens, scale, window, max(context_lens), partitions,
                          k_scale=k_scale, v_scale=v_scale)
    expected = expected_attention(q, attention.dequantize_kv(k8, k_scale, torch.float64),
                                  attention.dequantize_kv(v8, v_scale, torch.float64), block_tables, context_lens,
                                  query_lens, scale, window)
    assert torch.isfinite(out).all()
    assert rel_err(out.cpu(), expected) < (1e-6 if dtype == torch.float32 else 1e-2)
    # and the torch path (the CPU runtime's) reads the FP8 cache the same way
    torch_out = attention.paged_attention(q.double(), k8, v8, block_tables, lens(context_lens, "cpu"), query_lens,
                                          scale, window, k_scale=k_scale, v_scale=v_scale)
    assert rel_err(torch_out, expected) < 1e-6


@pytest.mark.parametrize("kv_dtype", FP8_KV)
def test_rotate_and_write_kv_kernel_quantizes_to_fp8(elementwise_case, kv_dtype) -> None:
    """The kernel stores clamp(x / scale) in FP8 like the torch path, of the rotated k (rounded to
    its dtype first, as the torch path stores it) and of v; values past the range saturate. The
    interpreter's FP8 cast may halve a value that rounds up into the next binade (conftest) and
    rounds exact ties away from zero (not to even), so the CPU allows those two; a GPU must match v
    exactly, and k within one FP8 step (its FMA may round the rotated k one 16-bit step apart).
    float32 only on the CPU: there the rotated k is the torch path's bit for bit."""
    from llmc.kernels.attention_triton import rotate_and_write_kv

    device, dtype = elementwise_case
    if device == "cpu" and dtype != torch.float32:
        pytest.skip("the interpreter truncates the rotated k to 16 bits (conftest): the FP8 values would differ")
    torch.manual_seed(0)  # the CPU allowances hold for almost every draw, not all (a tie computed two ways)
    num_tokens, num_heads, num_kv_heads, head_dim, num_blocks, block_size = 7, 4, 3, 24, 5, 4
    qkv, sizes, cos_sin, positions = rotary_step(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    qkv[:, sizes[0] + sizes[1]:] *= 1e5  # v saturates e4m3 and e5m2 at scale 1.5
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=kv_dtype)
    v_cache = torch.zeros_like(k_cache)
    q, k, v = split_qkv(qkv, sizes, head_dim)
    _, rotated_k = rotary.apply_rotary(q, k, positions, cos_sin)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    attention.write_kv_cache(rotated_k, v, expected_k, expected_v, slots, 0.05, 1.5)
    q_dev, k_dev, v_dev = split_qkv(qkv.to(device), sizes, head_dim)
    k_cache, v_cache = k_cache.to(device), v_cache.to(device)
    rotate_and_write_kv(q_dev, k_dev, v_dev, positions.to(device), cos_sin.to(device), k_cache, v_cache,
                        slots.to(device), 0.05, 1.5)
    written = slots.div(block_size, rounding_mode="floor"), slots % block_size
    for x, scale, cache, expected in ((rotated_k, 0.05, k_cache, expected_k), (v, 1.5, v_cache, expected_v)):
        actual, expected = cache.cpu()[written].float(), expected[written].float()  # [7, heads, head_dim]
        assert torch.isfinite(actual).all()
        if device == "cuda" and cache is v_cache:
            assert torch.equal(actual, expected)
        elif device == "cuda":
            step = 2.0 ** -(3 if kv_dtype == torch.float8_e4m3fn else 2)  # mantissa bits: one step, relative
            assert ((actual - expected).abs() <= expected.abs() * step).all()
        else:
            is_tie = (actual + expected) / 2 == x.float() * (1.0 / scale)
            assert ((actual == expected) | (actual * 2 == expected) | is_tie).all()
            assert (actual == expected).float().mean() > 0.8
    assert expected_v.float().abs().max() == torch.finfo(kv_dtype).max  # the saturation was exercised


# ---- logit soft-capping (Gemma 2's attn_logit_softcapping) ------------------------------------------------------

# scores q.k * d^-0.5 of these random heads have std ~1 and reach ~4: a cap of 1.5 changes the softmax a lot
SOFTCAP = 1.5


def test_torch_path_soft_caps_the_scaled_scores_before_the_mask() -> None:
    """The torch path (the CPU runtime's, and the kernels' oracle) against transformers' eager formula written out
    here in float64 for one fresh prompt: scores * scale, / cap, tanh, * cap, then the causal and window mask and
    the softmax. The cap changes the result (it is not a no-op on these scores)."""
    context, num_heads, num_kv_heads, head_dim, block_size, window = 37, 4, 2, 16, 8, 11
    q, k_cache, v_cache, block_tables = make_batch([context], [context], num_heads, num_kv_heads, head_dim,
                                                   block_size, torch.float64, "cpu")
    blocks = block_tables[0, : -(-context // block_size)].long()
    k = k_cache[blocks].flatten(0, 1)[:context].repeat_interleave(num_heads // num_kv_heads, dim=1)  # [ctx, heads, d]
    v = v_cache[blocks].flatten(0, 1)[:context].repeat_interleave(num_heads // num_kv_heads, dim=1)
    scale = 0.3
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    assert scores.abs().max() > 3 * SOFTCAP
    positions = torch.arange(context)
    masked = (positions[None, :] > positions[:, None]) | (positions[:, None] - positions[None, :] >= window)
    outs = []
    for cap, capped in ((SOFTCAP, torch.tanh(scores / SOFTCAP) * SOFTCAP), (None, scores)):
        probs = torch.softmax(capped.masked_fill(masked, float("-inf")), dim=-1)
        expected = torch.einsum("hqk,khd->qhd", probs, v)
        outs.append(attention.paged_attention(q, k_cache, v_cache, block_tables, lens([context], "cpu"), [context],
                                              scale, window, softcap=cap))
        torch.testing.assert_close(outs[-1], expected, rtol=1e-5, atol=1e-5)  # the torch path's scores: float32
    assert (outs[0] - outs[1]).abs().max() > 0.1


def _merge_case_batch(dot_case, monkeypatch, case: str, merge_in_kernel_min_pairs: int):
    """CASES[case]'s (q, k_cache, v_cache, block_tables) on dot_case's device and dtype, partitions merged in the decode
    kernel from merge_in_kernel_min_pairs (query, head) pairs on; a case without a split skips the second merge."""
    device, dtype = dot_case
    context_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, _, partitions = CASES[case]
    if merge_in_kernel_min_pairs > 1 and not partitions:
        pytest.skip("no split: no merge")
    monkeypatch.setattr(attention, "MERGE_IN_KERNEL_MIN_PAIRS", merge_in_kernel_min_pairs)
    return make_batch(context_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device)


@pytest.mark.parametrize("merge_in_kernel_min_pairs", [1, 10**9])  # merged in the decode kernel; by the second
@pytest.mark.parametrize("case", ["decode-gqa", "mixed-chunked", "window", "partitioned-decode", "partitioned-window",
                                  "partitioned-mixed"])
def test_paged_attention_kernels_soft_cap_the_scores(dot_case, rel_err, monkeypatch, case,
                                                     merge_in_kernel_min_pairs) -> None:
    """Decode (unsplit and split, both merges), prefill and chunked prefill, GQA, the window, with SOFTCAP: against
    the float64 torch path with the same cap, far from the uncapped result."""
    from llmc.kernels.attention_triton import paged_attention

    device, dtype = dot_case
    context_lens, query_lens, num_heads, _, head_dim, _, window, partitions = CASES[case]
    q, k_cache, v_cache, block_tables = _merge_case_batch(dot_case, monkeypatch, case, merge_in_kernel_min_pairs)
    scale = head_dim**-0.5
    out = paged_attention(q, k_cache, v_cache, block_tables, lens(context_lens, device), query_lens, scale, window,
                          max(context_lens), partitions, softcap=SOFTCAP)
    expected = expected_attention(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale, window, SOFTCAP)
    uncapped = expected_attention(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale, window)
    assert torch.isfinite(out).all()
    assert rel_err(out.cpu(), expected) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert rel_err(uncapped, expected) > 0.05  # the cap matters on these scores


@pytest.mark.parametrize("case", ["mixed-chunked", "partitioned-window"])
def test_paged_attention_kernels_soft_cap_over_an_fp8_cache(dot_case, rel_err, case) -> None:
    """The FP8 K scale folded into the tanh's argument (scale * k_scale / cap): against float64 over the
    dequantized cache."""
    from llmc.kernels.attention_triton import paged_attention

    device, dtype = dot_case
    context_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, window, partitions = CASES[case]
    q, k_cache, v_cache, block_tables = make_batch(
        context_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32, "cpu"
    )
    k_scale, v_scale, kv_dtype = 0.37, 2.5, torch.float8_e4m3fn
    k8, v8 = attention.quantize_kv(k_cache, k_scale, kv_dtype), attention.quantize_kv(v_cache, v_scale, kv_dtype)
    scale = head_dim**-0.5
    out = paged_attention(q.to(device, dtype), k8.to(device), v8.to(device), block_tables.to(device),
                          lens(context_lens, device), query_lens, scale, window, max(context_lens), partitions,
                          k_scale=k_scale, v_scale=v_scale, softcap=SOFTCAP)
    expected = expected_attention(q, attention.dequantize_kv(k8, k_scale, torch.float64),
                                  attention.dequantize_kv(v8, v_scale, torch.float64), block_tables, context_lens,
                                  query_lens, scale, window, SOFTCAP)
    assert rel_err(out.cpu(), expected) < (1e-6 if dtype == torch.float32 else 1e-2)
    torch_out = attention.paged_attention(q.double(), k8, v8, block_tables, lens(context_lens, "cpu"), query_lens,
                                          scale, window, k_scale=k_scale, v_scale=v_scale, softcap=SOFTCAP)
    assert rel_err(torch_out, expected) < 1e-6


def test_prefill_index_soft_caps_the_scores(dot_case, rel_err) -> None:
    """The indexed prefill (FULL CUDA graphs of mixed steps) with SOFTCAP and a window, against float64."""
    dtype = dot_case[1]
    out, (q, k_cache, v_cache, block_tables, context_lens, query_lens, window) = _indexed_prefill(dot_case,
                                                                                                   softcap=SOFTCAP)
    expected = expected_attention(q, k_cache, v_cache, block_tables, context_lens, query_lens, q.shape[-1]**-0.5,
                                  window, SOFTCAP)
    assert rel_err(out.cpu(), expected) < (1e-6 if dtype == torch.float32 else 1e-2)


def _indexed_prefill(dot_case, window: int | None = 20, **kwargs):
    """A padded mixed step (a chunk after cached tokens, a decode row, a whole prompt, a one-token prompt; a window of
    `window`) through the indexed prefill kernel (a FULL CUDA graph's, kernels.attention.PrefillIndex) with `kwargs`:
    (its n rows' output, (q, k_cache, v_cache, block_tables, context_lens, query_lens, window))."""
    from llmc.kernels.attention_triton import paged_attention

    device, dtype = dot_case
    context_lens, query_lens = [40, 17, 33, 1], [13, 1, 33, 1]
    num_heads, num_kv_heads, head_dim, block_size, size = 8, 2, 16, 8, 64
    q, k_cache, v_cache, block_tables = make_batch(context_lens, query_lens, num_heads, num_kv_heads, head_dim,
                                                   block_size, dtype, device)
    n, per_block = q.shape[0], attention.prefill_queries_per_block(num_heads // num_kv_heads)
    blocks = attention.prefill_blocks(query_lens, per_block)
    num_blocks, pad = attention.max_prefill_blocks(size, 5, per_block), 4
    index = attention.PrefillIndex(
        query_lens=lens(query_lens + [0], device), first_rows=lens([0, 13, 14, 47, 0], device),
        block_seqs=lens([seq for seq, _ in blocks] + [pad] * (num_blocks - len(blocks)), device),
        block_starts=lens([start for _, start in blocks] + [0] * (num_blocks - len(blocks)), device),
        queries_per_block=per_block, out=torch.zeros((size, num_heads, head_dim), dtype=dtype, device=device),
    )
    q_padded = torch.cat([q, torch.zeros((size - n, num_heads, head_dim), dtype=dtype, device=device)])
    out = paged_attention(q_padded, k_cache, v_cache, torch.cat([block_tables, block_tables[:1]]),
                          lens(context_lens + [0], device), [size], head_dim**-0.5, window, prefill_index=index,
                          **kwargs)
    return out[:n], (q, k_cache, v_cache, block_tables, context_lens, query_lens, window)


@pytest.mark.parametrize("case", ["split-merged-in-kernel", "fp8-cache"])
def test_decode_step_rotating_in_the_decode_kernel_soft_caps_too(dot_case, rel_err, case) -> None:
    """rotate_write_and_attend's decode-only path (rotary and KV write in the decode kernel) with SOFTCAP: the
    bits of rotate_and_write_kv then paged_attention, and the float64 torch path's result."""
    from llmc.kernels import attention_triton

    device, dtype = dot_case
    context_lens, _, _, head_dim, window, partitions, _, fp8 = ROTATE_CASES[case]
    qkv, sizes, k_cache, v_cache, scales, block_tables, positions, cos_sin, slots, ctx = _rotating_decode_step(
        case, dtype, device)
    scale, seqs = head_dim**-0.5, [1] * len(context_lens)
    common = dict(num_partitions=partitions, k_scale=scales[0], v_scale=scales[1], softcap=SOFTCAP)
    q, k, v = split_qkv(qkv.clone(), sizes, head_dim)
    k_fused, v_fused = k_cache.clone(), v_cache.clone()
    fused = attention_triton.paged_attention(q, k_fused, v_fused, block_tables, ctx, seqs, scale, window, 2048,
                                             rotary=(k, v, positions, cos_sin, slots), **common)
    k_c, v_c = k_cache.clone(), v_cache.clone()
    q = attention_triton.rotate_and_write_kv(q, k, v, positions, cos_sin, k_c, v_c, slots, *scales)
    assert torch.equal(fused, attention_triton.paged_attention(q, k_c, v_c, block_tables, ctx, seqs, scale, window,
                                                               2048, **common))
    as64 = (lambda t: t.cpu()) if fp8 else (lambda t: t.cpu().double())  # noqa: E731  (FP8: the torch path's read)
    expected = attention.paged_attention(q.cpu().double(), as64(k_c), as64(v_c), block_tables.cpu(),
                                         ctx.cpu(), seqs, scale, window, k_scale=scales[0], v_scale=scales[1],
                                         softcap=SOFTCAP)
    assert rel_err(fused.cpu(), expected) < (1e-6 if dtype == torch.float32 else 1e-2)


def dense_image_attention(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale, window, spans):
    """float64 attention from the rule itself (transformers' Gemma 3 masks): a query at position p sees key t when
    t <= p, or when both are in one image span; and, on a sliding layer, when p - t < window."""
    out, start = torch.empty(q.shape, dtype=torch.float64), 0
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    for seq, (context_len, query_len) in enumerate(zip(context_lens, query_lens)):
        slots = [int(block_tables[seq, t // block_size]) * block_size + t % block_size for t in range(context_len)]
        k = k_cache.cpu().double().flatten(0, 1)[slots].repeat_interleave(group, dim=1)  # [context, heads, dim]
        v = v_cache.cpu().double().flatten(0, 1)[slots].repeat_interleave(group, dim=1)
        for i in range(query_len):
            p = context_len - query_len + i
            image = next(((lo, hi) for lo, hi in spans[seq] if lo <= p < hi), None)
            seen = [t for t in range(context_len) if (t <= p or (image and image[0] <= t < image[1]))
                    and (window is None or p - t < window)]
            scores = torch.einsum("hd,thd->ht", q[start + i].cpu().double(), k[seen]) * scale
            out[start + i] = torch.einsum("ht,thd->hd", torch.softmax(scores, dim=-1), v[seen])
        start += query_len
    return out


@pytest.mark.parametrize("window", [None, 6])
def test_key_limits_let_an_images_tokens_see_the_whole_image(dot_case, rel_err, window) -> None:
    """Gemma 3's image tokens attend to their whole image (key_limits: the image's last position), beside a
    sequence without images and a decode row; the kernel and the torch path match float64 from the rule itself.
    Sequence 0's chunk holds a whole image and the start of none; sequence 1's chunk begins mid-image (a prefix-cache
    hit inside it) and holds a second image."""
    from llmc.kernels.attention_triton import paged_attention as kernel

    device, dtype = dot_case
    context_lens, query_lens = [30, 40, 12, 9], [20, 25, 12, 1]
    spans = [[(14, 19)], [(13, 20), (24, 30)], [], []]
    q, k_cache, v_cache, block_tables = make_batch(context_lens, query_lens, 4, 2, 16, 8, dtype, device, seed=3)
    limits = []
    for seq, (context_len, query_len) in enumerate(zip(context_lens, query_lens)):
        for p in range(context_len - query_len, context_len):
            limits.append(next((hi - 1 for lo, hi in spans[seq] if lo <= p < hi), p))
    key_limits = torch.tensor(limits, dtype=torch.int32, device=device)
    expected = dense_image_attention(q, k_cache, v_cache, block_tables, context_lens, query_lens, 0.25, window, spans)
    out = kernel(q, k_cache, v_cache, block_tables, lens(context_lens, device), query_lens, 0.25, window,
                 max(context_lens), key_limits=key_limits)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert torch.isfinite(out).all() and rel_err(out.cpu(), expected) < tol
    torch_path = attention.paged_attention(q.cpu().double(), k_cache.cpu().double(), v_cache.cpu().double(),
                                           block_tables.cpu(), lens(context_lens, "cpu"), query_lens, 0.25, window,
                                           key_limits=key_limits.cpu())
    assert rel_err(torch_path, expected) < 1e-6  # (the torch path scores in float32)
    causal = expected_attention(q, k_cache, v_cache, block_tables, context_lens, query_lens, 0.25, window)
    assert rel_err(causal, expected) > 1e-3  # the limits changed the image rows


# ---- attention sinks (gpt-oss's self_attn.sinks) ------------------------------------------------------------------


def head_sinks(num_heads: int, device="cpu") -> torch.Tensor:
    """[num_heads] float32 sink logits around the scores' size (std ~1, up to ~4): large enough to take much of a
    row's weight, and different per head (a head mix-up shows)."""
    return (torch.randn(num_heads, generator=torch.Generator().manual_seed(7)) * 1.5 + 1.0).to(device)


def test_torch_path_attention_sinks_are_transformers_gpt_oss_attention() -> None:
    """The torch path (the CPU runtime's, and the kernels' oracle) with sinks against transformers' own GptOss eager
    attention (modeling_gpt_oss.eager_attention_forward) in float64 over one prompt with a window, prefilled whole,
    in chunks and as decode rows; the sinks matter (the output moves without them)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    context, num_heads, num_kv_heads, head_dim, block_size, window = 37, 4, 2, 16, 8, 11
    q, k_cache, v_cache, block_tables = make_batch([context], [context], num_heads, num_kv_heads, head_dim,
                                                   block_size, torch.float64, "cpu")
    blocks = block_tables[0, : -(-context // block_size)].long()
    k = k_cache[blocks].flatten(0, 1)[:context]  # [ctx, kv heads, d]
    v = v_cache[blocks].flatten(0, 1)[:context]
    sinks, scale = head_sinks(num_heads), 0.3
    positions = torch.arange(context)
    masked = (positions[None, :] > positions[:, None]) | (positions[:, None] - positions[None, :] >= window)
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups = sinks.double(), num_heads // num_kv_heads
    expected, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          v.transpose(0, 1)[None], torch.zeros(context, context, dtype=torch.float64)
                                          .masked_fill(masked, float("-inf"))[None, None], scale)
    expected = expected[0]  # [ctx, heads, d]
    ctx = lens([context], "cpu")
    whole = attention.paged_attention(q, k_cache, v_cache, block_tables, ctx, [context], scale, window, sinks=sinks)
    torch.testing.assert_close(whole, expected, rtol=1e-5, atol=1e-5)  # (the torch path's scores: float32)
    for start, end in ((0, 13), (13, 36), (36, 37)):  # chunks, then a decode row, each over its context so far
        part = attention.paged_attention(q[start:end], k_cache, v_cache, block_tables, lens([end], "cpu"),
                                         [end - start], scale, window, sinks=sinks)
        torch.testing.assert_close(part, expected[start:end], rtol=1e-5, atol=1e-5)  # (the torch path's scores: float32)
    without = attention.paged_attention(q, k_cache, v_cache, block_tables, ctx, [context], scale, window)
    assert (without - whole).abs().max() > 0.1


@pytest.mark.parametrize("merge_in_kernel_min_pairs", [1, 10**9])  # merged in the decode kernel; by the second
@pytest.mark.parametrize("case", ["decode-gqa", "mixed-chunked", "window", "partitioned-window", "partitioned-mixed"])
def test_paged_attention_kernels_add_the_sinks(dot_case, rel_err, monkeypatch, case, merge_in_kernel_min_pairs) -> None:
    """Decode (unsplit and split, both merges), prefill and chunked prefill, GQA, the window, with sinks: against the
    float64 torch path with the same sinks, far from the result without them."""
    from llmc.kernels.attention_triton import paged_attention

    device, dtype = dot_case
    context_lens, query_lens, num_heads, _, head_dim, _, window, partitions = CASES[case]
    q, k_cache, v_cache, block_tables = _merge_case_batch(dot_case, monkeypatch, case, merge_in_kernel_min_pairs)
    # the sinks weigh as much as the longest row's keys together: they matter at 300 keys too
    scale, sinks = head_dim**-0.5, head_sinks(num_heads) + math.log(min(max(context_lens), window or 10**9))
    out = paged_attention(q, k_cache, v_cache, block_tables, lens(context_lens, device), query_lens, scale, window,
                          max(context_lens), partitions, sinks=sinks.to(device))
    as64 = lambda t: t.cpu().double()  # noqa: E731
    expected = attention.paged_attention(as64(q), as64(k_cache), as64(v_cache), block_tables.cpu(),
                                         lens(context_lens, "cpu"), query_lens, scale, window, sinks=sinks)
    plain = expected_attention(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale, window)
    assert torch.isfinite(out).all()
    assert rel_err(out.cpu(), expected) < (1e-6 if dtype == torch.float32 else 1e-2)
    assert rel_err(plain, expected) > 0.05  # the sinks matter here


def test_prefill_index_and_the_fused_decode_step_add_the_sinks(dot_case, rel_err) -> None:
    """The indexed prefill (FULL CUDA graphs of mixed steps) and rotate_write_and_attend's decode-only step (rotary
    and KV write in the decode kernel, split and merged in it) with sinks, against the float64 torch path."""
    from llmc.kernels import attention_triton

    device, dtype = dot_case
    sinks = head_sinks(8)  # (_indexed_prefill's 8 heads)
    out, (q, k_cache, v_cache, block_tables, context_lens, query_lens, window) = _indexed_prefill(
        dot_case, sinks=sinks.to(device))
    as64 = lambda t: t.cpu().double()  # noqa: E731
    expected = attention.paged_attention(as64(q), as64(k_cache), as64(v_cache), block_tables.cpu(),
                                         lens(context_lens, "cpu"), query_lens, q.shape[-1]**-0.5, window, sinks=sinks)
    assert rel_err(out.cpu(), expected) < (1e-6 if dtype == torch.float32 else 1e-2)

    context_lens, num_heads, _, head_dim, window, partitions, _, _ = ROTATE_CASES["split-merged-in-kernel"]
    sinks = head_sinks(num_heads)
    qkv, sizes, k_cache, v_cache, _, block_tables, positions, cos_sin, slots, ctx = _rotating_decode_step(
        "split-merged-in-kernel", dtype, device)
    scale, seqs = head_dim**-0.5, [1] * len(context_lens)
    q, k, v = split_qkv(qkv.clone(), sizes, head_dim)
    fused = attention_triton.paged_attention(q, k_cache, v_cache, block_tables, ctx, seqs, scale, window, 2048,
                                             partitions, rotary=(k, v, positions, cos_sin, slots),
                                             sinks=sinks.to(device))
    q = rotary.apply_rotary(q, k, positions, cos_sin)[0]
    expected = attention.paged_attention(as64(q), as64(k_cache), as64(v_cache), block_tables.cpu(), ctx.cpu(), seqs,
                                         scale, window, sinks=sinks)
    assert rel_err(fused.cpu(), expected) < (1e-6 if dtype == torch.float32 else 1e-2)


_COMPILE_SM90_SINKS = r"""
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llmc.kernels import attention_triton as at

POINTERS = {"bt_ptr": "*i32", "ctx_ptr": "*i32", "seq_ptr": "*i32", "row_ptr": "*i32", "counter_ptr": "*i32",
            "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "pos_ptr": "*i64", "slot_ptr": "*i64",
            "cos_sin_ptr": "*fp32", "sink_ptr": "*fp32", "qlen_ptr": "*i32", "qoff_ptr": "*i32",
            "blk_seq_ptr": "*i32", "blk_q_ptr": "*i32", "limit_ptr": "*i32"}
FLOATS = ("scale_log2", "v_scale", "inv_k_scale", "inv_v_scale")


def compile_facts(kernel, constants, num_warps=4):
    sig = {n: "constexpr" if n in constants else POINTERS.get(n, "*bf16") if n.endswith("_ptr")
           else "fp32" if n in FLOATS else "i32" for n in kernel.arg_names}
    names = list(kernel.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*")}
    source = ASTSource(kernel, sig, constants, attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    ptx = compiled.asm["ptx"]
    return {"mma": "mma.sync" in ptx or "wgmma" in ptx, "local": ".local" in ptx, "shared": compiled.metadata.shared}


facts = {}
try:
    for split, merge in ((False, False), (True, True), (True, False)):
        constants = {"GROUP": 8, "HEAD_DIM": 64, "BLOCK_G": 16, "BLOCK_D": 64, "BLOCK_N": 64, "BLOCK_SIZE": 16,
                     "IS_PARTITIONED": split, "HAS_WINDOW": True, "PRECISION": "tf32", "IS_DENSE": True,
                     "MERGE_IN_KERNEL": merge, "ROTATE": True, "FP8_MAX": 0.0, "PDL": False, "SOFTCAP": 0.0,
                     "HAS_SINKS": True}
        facts[f"decode-{split}-{merge}"] = compile_facts(at._decode_kernel, constants)
    facts["merge"] = compile_facts(at._merge_partitions_kernel, {"HEAD_DIM": 64, "BLOCK_P": 64, "BLOCK_D": 64,
                                                                 "IS_DENSE": True, "HAS_WINDOW": True, "PDL": False,
                                                                 "HAS_SINKS": True})
    facts["prefill"] = compile_facts(at._prefill_kernel, {
        "GROUP": 8, "QUERIES_PER_BLOCK": 8, "HEAD_DIM": 64, "BLOCK_R": 64, "BLOCK_D": 64, "BLOCK_N": 64,
        "BLOCK_SIZE": 16, "HAS_WINDOW": True, "PRECISION": "tf32", "SOFTCAP": 0.0, "HAS_LIMITS": False,
        "limit_ptr": None, "HAS_SINKS": True})
except FileNotFoundError as exc:  # a triton without its bundled ptxas
    print("SKIP", exc)
    raise SystemExit(0)
print(json.dumps(facts))
"""


def test_the_kernels_with_sinks_compile_for_sm90_at_gpt_oss_shapes():
    """The decode kernel (unsplit; split, merged in it or not; rotating), the second merge and the prefill kernel with
    sinks, at gpt-oss's heads (64 dims, 8 query heads per KV head, bf16, a window), compiled for an H100 / H200 on this
    machine (the installed triton and its ptxas, in a process of its own, not the interpreter the other tests run):
    tensor-core products where there are dots, no local memory."""
    from tests.kernels.conftest import sm90_compile_facts

    facts = sm90_compile_facts(_COMPILE_SM90_SINKS)
    assert len(facts) == 5
    for name, kernel in facts.items():
        assert (kernel["mma"] or name == "merge") and not kernel["local"] and kernel["shared"] <= 227 * 1024, (name, kernel)
