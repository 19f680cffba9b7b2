"""Randomized CPU tests of cudagraph_mode FULL's pieces (runtime/mixed_graphs.py, kernels.attention.PrefillIndex).

1. kernels.attention_triton.paged_attention with a PrefillIndex padded to a larger token count (the
   way runtime/mixed_graphs.py fills it: stale unused sequences, padding blocks, stale block-table rows
   and columns, a NaN q in the padding rows, a pre-filled output buffer) against the same function
   without the index (the eager path: decode kernel for 1-token rows, prefill kernel for the rest),
   under the Triton interpreter; and both against the float64 torch oracle.
2. MixedGraphs.run against the model's own forward over several random steps in a row on the same
   MixedGraphs instance (stale buffers), as
   tests/runtime/test_piecewise_graphs.py::test_the_whole_graph_forward_reads_its_sequences_from_the_index.

Written by a reviewer of the FULL mode (session 34); 40 seeds of part 1 passed then, 12 run here.
"""

import math
import os
import random

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from llmc.kernels import attention

# ---------------------------------------------------------------------------------------------------------
# 1. the kernel


def _lens(values, device="cpu"):
    return torch.tensor(values, dtype=torch.int32, device=device)


def _make_step(rng, context_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, extra_cols):
    """q, caches (slots no sequence owns: NaN), block tables (random blocks, stale extra columns)."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    blocks_per_seq = [max(1, math.ceil(n / block_size)) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 4
    order = list(range(1, num_blocks))
    rng.shuffle(order)
    width = max(blocks_per_seq) + extra_cols
    tables = torch.zeros(len(context_lens), width, dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    for seq, (ctx, nb) in enumerate(zip(context_lens, blocks_per_seq)):
        blocks = torch.tensor([order.pop() for _ in range(nb)], dtype=torch.int32)
        tables[seq, :nb] = blocks
        slots = (blocks.long()[:, None] * block_size + torch.arange(block_size)).flatten()[:ctx]
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        attention.write_kv_cache(k, v, k_cache, v_cache, slots)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, tables


HEADS = [(8, 2), (4, 4), (6, 2), (4, 1), (16, 2)]  # (q heads, kv heads): groups 4, 1, 3, 4, 8


@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seed", range(12))
def test_prefill_index_padded_step_matches_the_eager_path(seed, dtype, kv):
    from llmc.kernels.attention_triton import paged_attention

    rng = random.Random(1000 * seed + (dtype == torch.float16))
    max_seqs = rng.randint(1, 6)
    num_seqs = rng.randint(1, max_seqs)
    num_heads, num_kv_heads = HEADS[seed % len(HEADS)]
    head_dim = rng.choice([16, 24, 32])
    block_size = rng.choice([8, 16])
    window = rng.choice([None, None, rng.randint(1, 30)])
    query_lens = [rng.choice([1, 1, rng.randint(2, 40), rng.randint(2, 90)]) for _ in range(num_seqs)]
    context_lens = [q + rng.choice([0, rng.randint(0, 60)]) for q in query_lens]
    n = sum(query_lens)
    size = n + rng.randint(0, 40)  # the captured token count
    q, k_cache, v_cache, tables = _make_step(rng, context_lens, query_lens, num_heads, num_kv_heads, head_dim,
                                             block_size, dtype, extra_cols=rng.randint(0, 3))
    scale = head_dim**-0.5
    k_scale = v_scale = 1.0
    if kv == "fp8":  # an FP8 cache with its scales; the oracle reads it dequantized
        k_scale, v_scale = 0.37, 1.9
        k_cache = (k_cache.float() / k_scale).to(torch.float8_e4m3fn)
        v_cache = (v_cache.float() / v_scale).to(torch.float8_e4m3fn)

    # the index as MixedGraphs.load fills it, with stale values where a stale buffer would hold them
    per_block = attention.prefill_queries_per_block(num_heads // num_kv_heads)
    blocks = attention.prefill_blocks(query_lens, per_block)
    num_blocks = attention.max_prefill_blocks(size, max_seqs, per_block)
    assert len(blocks) <= num_blocks
    pad = max_seqs
    stale = max_seqs - num_seqs
    first_rows = [0]
    for ql in query_lens[:-1]:
        first_rows.append(first_rows[-1] + ql)
    index = attention.PrefillIndex(
        query_lens=_lens(query_lens + [0] * (stale + 1)),
        first_rows=_lens(first_rows + [rng.randint(0, size) for _ in range(stale)] + [0]),
        block_seqs=_lens([s for s, _ in blocks] + [pad] * (num_blocks - len(blocks))),
        block_starts=_lens([b for _, b in blocks] + [0] * (num_blocks - len(blocks))),
        queries_per_block=per_block,
        out=torch.randn(size + 3, num_heads, head_dim).to(dtype),  # what an earlier step left
    )
    before = index.out.clone()
    ctx_all = _lens(context_lens + [rng.randint(1, 50) for _ in range(stale)] + [0])
    stale_rows = torch.randint(0, k_cache.shape[0], (stale + 1, tables.shape[1]), dtype=torch.int32)
    stale_rows[-1] = 0  # the padding sequence's row: the scratch block in MixedGraphs (never read)
    tables_all = torch.cat([tables, stale_rows])
    q_padded = torch.cat([q, torch.full((size - n, num_heads, head_dim), float("nan"), dtype=dtype)])

    indexed = paged_attention(q_padded, k_cache, v_cache, tables_all, ctx_all, [size], scale, window,
                              k_scale=k_scale, v_scale=v_scale, prefill_index=index)
    eager = paged_attention(q, k_cache, v_cache, tables, _lens(context_lens), query_lens, scale, window,
                            max_context_len=max(context_lens), k_scale=k_scale, v_scale=v_scale)
    oracle = attention.paged_attention(q.double(), (k_cache.double() * k_scale), (v_cache.double() * v_scale), tables,
                                       _lens(context_lens), query_lens, scale, window)
    desc = dict(query_lens=query_lens, context_lens=context_lens, size=size, window=window,
                heads=(num_heads, num_kv_heads), head_dim=head_dim, block_size=block_size, max_seqs=max_seqs)
    assert indexed.data_ptr() == index.out.data_ptr()
    assert torch.isfinite(indexed[:n]).all(), desc
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(indexed[:n].double(), eager.double(), atol=tol, rtol=tol, msg=lambda m: f"{desc}\n{m}")
    torch.testing.assert_close(indexed[:n].double(), oracle, atol=tol * 5, rtol=tol * 5,
                               msg=lambda m: f"{desc}\n{m}")
    assert torch.equal(index.out[n:], before[n:]), desc  # padding rows and beyond: untouched


# ---------------------------------------------------------------------------------------------------------
# 2. MixedGraphs.run against the model's forward, several random steps on one instance

BLOCK_SIZE = 16
NUM_BLOCKS = 40
MAX_MODEL_LEN = 128


def _artifact(checkpoint, out):
    from llmc.compiler.build import build
    from llmc.compiler.recipe import recipe_from_dict

    build(recipe_from_dict({"model": str(checkpoint), "output": str(out), "dtype": "float32",
                            "quantization": {"method": "none"},
                            "runtime": {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": 8}}), show_progress=False)
    return out


@pytest.fixture(scope="module")
def windowed_mistral_fuzz(tmp_path_factory, hf_checkpoint_factory):
    return hf_checkpoint_factory(tmp_path_factory.mktemp("windowed_mistral_fuzz"), "mistral", sliding_window=8)


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("family", ["tiny_llama", "windowed_mistral_fuzz",  # 3-5 s per kernel
                                    *(pytest.param(f, marks=pytest.mark.slow) for f in ("tiny_qwen3", "tiny_qwen3_moe"))])
@torch.inference_mode()
def test_mixed_graphs_run_matches_the_model_over_random_steps(family, kernel, request, tmp_path, monkeypatch,
                                                             forward_step):
    """kernel "triton": the graph forward's attention (the calls with a PrefillIndex) runs the Triton
    prefill kernel in the interpreter, so block_seqs / block_starts / first_rows as MixedGraphs.load
    leaves them (stale entries included) are what is read; the eager reference stays on the torch path."""
    from llmc.runtime import artifact as art
    from llmc.runtime.mixed_graphs import MixedGraphs
    from llmc.runtime.model_runner import ModelRunner, allocate_kv_caches
    from llmc.runtime.options import resolve_options
    from llmc.runtime.parallel.layout import whole_model_layout

    artifact = _artifact(request.getfixturevalue(family), tmp_path / "a")
    manifest = art.read_manifest(artifact)
    runner = ModelRunner(artifact, manifest, resolve_options(manifest, {"num_kv_blocks": NUM_BLOCKS}),
                         torch.device("cpu"))
    runner.kv_caches = allocate_kv_caches(manifest, whole_model_layout(manifest.model), NUM_BLOCKS + 1, BLOCK_SIZE,
                                          torch.device("cpu"))
    runner.model.bind_kv_caches(runner.kv_caches)
    model = runner.model
    gen = torch.Generator().manual_seed(1)
    for k, v in runner.kv_caches:  # cached prefixes: random keys and values everywhere
        k.copy_(torch.randn(k.shape, generator=gen))
        v.copy_(torch.randn(v.shape, generator=gen))
    sizes, max_seqs = [8, 16, 24, 32, 48, 64], 5
    graphs = MixedGraphs(model, sizes, max_seqs, MAX_MODEL_LEN, BLOCK_SIZE, NUM_BLOCKS, torch.device("cpu"))
    if kernel == "triton":
        from llmc.kernels import attention_triton

        torch_paged_attention = attention.paged_attention
        indexed_calls = []

        def paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_lens, *args, **kwargs):
            if kwargs.get("prefill_index") is None:
                return torch_paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_lens, *args,
                                             **kwargs)
            indexed_calls.append(1)
            names = ["scale", "sliding_window", "max_context_len", "k_scale", "v_scale", "index_cache"]
            kw = dict(zip(names, args)) | kwargs
            return attention_triton.paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_lens, **kw)

        monkeypatch.setattr(attention, "paged_attention", paged_attention)
    rng = random.Random(sum(map(ord, family)))
    ran = 0
    for step in range(30):
        num_seqs = rng.randint(1, max_seqs)
        free = list(range(NUM_BLOCKS))
        rng.shuffle(free)
        seqs, budget = [], sizes[-1]
        for _ in range(num_seqs):
            new = rng.choice([1, 1, rng.randint(1, 24)])
            new = max(1, min(new, budget - (num_seqs - len(seqs) - 1)))
            budget -= new
            start = rng.choice([0, rng.randint(0, MAX_MODEL_LEN - new)])
            ctx = start + new
            blocks = [free.pop() for _ in range(-(-ctx // BLOCK_SIZE))]
            seqs.append((blocks, start, torch.randint(5, 200, (new,), generator=gen).tolist()))
        input_ids, batch = forward_step(seqs)
        assert graphs.can_run(batch), (step, [len(s[2]) for s in seqs])
        before = [torch.stack([k, v]).clone() for k, v in runner.kv_caches]
        eager = model(input_ids, batch).clone()
        eager_caches = [torch.stack([k, v]).clone() for k, v in runner.kv_caches]
        for (k, v), saved in zip(runner.kv_caches, before):
            k.copy_(saved[0])
            v.copy_(saved[1])
        hidden = graphs.run(input_ids, batch)
        desc = (step, [(len(b), s, len(nw)) for b, s, nw in seqs])
        torch.testing.assert_close(hidden, eager, atol=3e-5, rtol=3e-5, msg=lambda m: f"{desc}\n{m}")
        for whole, full in zip([torch.stack([k, v]) for k, v in runner.kv_caches], eager_caches):
            torch.testing.assert_close(whole[:, :NUM_BLOCKS], full[:, :NUM_BLOCKS], atol=3e-5, rtol=3e-5)
        ran += 1
    assert ran == 30 and graphs.num_replays == 30
    if kernel == "triton":
        assert len(indexed_calls) == 30 * len(model.layers)
