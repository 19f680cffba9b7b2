"""DeepSeek's multi-head latent attention over the paged latent cache (vLLM's MLA backend's layout), and its write.

The cache of one layer is one tensor [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]: per token the normed
compressed kv c_kv, then the rotated rope key k_pe every head shares (512 + 64 = 576 values for DeepSeek-V2 / V3),
paged by the block tables as attention.py's K and V are. Per head h, W_UK[h] [qk_nope_head_dim, kv_lora_rank] and
W_UV[h] [v_head_dim, kv_lora_rank] are kv_b's key and value rows (k_nope = W_UK c_kv, v = W_UV c_kv). Attention runs
in one of two forms of the same function (the DeepSeek-V2 paper's weight absorption):
  absorbed  q_latent = q_nope · W_UK; score = (q_latent · c_kv + q_pe · k_pe) * scale; out = softmax · c_kv · W_UV^T
  expanded  k_nope, v = expand(c_kv) for every cached key (kv_b over the context's latents, as vLLM's long
            prefills); score = (q_nope · k_nope + q_pe · k_pe) * scale; out = softmax · v
The absorbed form reads 576 values per key for every head at once; the expanded one computes num_heads * (qk_nope +
v) per key first, which pays back over many queries. On CUDA the absorbed form runs for every step in one Triton
kernel (mla_attention_triton.py: decode and prefill rows alike, each query row over its causal prefix); on a CPU the
torch code below picks a form per sequence by its queries against its context (takes_expanded, measured).

An FP8 cache (float8_e4m3fn / e5m2) stores clamp(x / kv_scale) for c_kv and k_pe alike: one scale per layer (the
artifact's k_scale; vLLM's MLA cache has one too). Shapes as attention.py's (query_lens on the host; prefill_index:
a mixed CUDA graph's sequences from device tensors).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from . import can_use_triton, to_device
from .attention import PrefillIndex, _causal_mask, dequantize_kv, is_fp8, quantize_kv

# On a CPU a sequence takes the expanded form where its step computes at least min(EXPAND_MIN_QUERIES, context //
# EXPAND_KEYS_PER_QUERY) queries (at least 1), else the absorbed form. The expanded form pays kv_b over the whole
# context once (num_heads * (qk_nope + v) * kv_lora_rank per key), the absorbed one about num_heads * 700 more per
# query and key at V2-Lite's shape: even at some 190 queries by count. Measured (benchmarks/mla_forms.py, 2 shared
# CPU cores, V2-Lite's 16 heads, float32 and bfloat16): at 2048 keys absorbed up to 64 queries, expanded at 256; at
# 256 keys expanded from 16 queries on (torch's per-call costs), either within noise below.
EXPAND_MIN_QUERIES = 128
EXPAND_KEYS_PER_QUERY = 16
FORMS = ("absorbed", "expanded")


def takes_expanded(query_len: int, context_len: int, form: str | None = None) -> bool:
    """Whether a sequence's step runs the expanded form on a CPU: `form` where given (FORMS), else the measured
    rule above."""
    if form is not None:
        return form == "expanded"
    return query_len >= max(1, min(EXPAND_MIN_QUERIES, context_len // EXPAND_KEYS_PER_QUERY))


def write_latent_cache(c_kv: Tensor, k_pe: Tensor, cache: Tensor, slot_mapping: Tensor, kv_scale: float = 1.0) -> None:
    """Store each token's [c_kv, k_pe] ([num_tokens, kv_lora_rank], [num_tokens, qk_rope_head_dim]) at its slot
    (quantized with kv_scale into an FP8 cache). One index_copy_ on every device (a CUDA graph captures it)."""
    latent = torch.cat((c_kv, k_pe), dim=-1)
    flat = cache.view(-1, cache.shape[-1])
    if is_fp8(cache):  # index_copy_ has no FP8 kernel on CPUs: copy the bytes
        latent, flat = quantize_kv(latent, kv_scale, cache.dtype).view(torch.uint8), flat.view(torch.uint8)
    flat.index_copy_(0, slot_mapping, latent.to(flat.dtype))


def mla_attention(
    q: Tensor, cache: Tensor, w_uk: Tensor, w_uv: Tensor, block_tables: Tensor, context_lens: Tensor,
    query_lens: list[int], scale: float, *, kv_scale: float = 1.0, max_context_len: int | None = None,
    expand: Callable[[Tensor], tuple[Tensor, Tensor]] | None = None, form: str | None = None,
    index_cache: dict | None = None, prefill_index: PrefillIndex | None = None, out: Tensor | None = None,
) -> Tensor:
    """Causal latent attention of each sequence's new queries over its cached latents.

    q [num_tokens, num_heads, qk_nope + qk_rope]: each head's q_nope, then its rotated q_pe. w_uk [num_heads, qk_nope,
    kv_lora_rank], w_uv [num_heads, v_head_dim, kv_lora_rank] in q's dtype. expand(c_kv [n, kv_lora_rank]) → (k_nope
    [n, num_heads, qk_nope], v [n, num_heads, v_head_dim]): the expanded form's kv_b (None: always absorbed). form:
    "absorbed" or "expanded" for every sequence on a CPU; None: each by takes_expanded's rule (CUDA: absorbed
    always). max_context_len: at least every context_lens entry (a host value: CUDA splits long contexts of few rows
    by it; None: no split). Returns [num_tokens, num_heads, v_head_dim]
    (into out[..., :v_head_dim] when given)."""
    nope = w_uk.shape[1]
    q_nope, q_pe = q.split([nope, q.shape[-1] - nope], dim=-1)
    if can_use_triton(q, cache):
        from . import mla_attention_triton  # triton loads on the first CUDA call only

        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [num_tokens, num_heads, kv_lora_rank]
        row_seq, row_limit = row_index(query_lens, context_lens, q.shape[0], index_cache, prefill_index)
        out_lat = mla_attention_triton.mla_absorbed_attention(q_lat, q_pe, cache, block_tables, row_seq, row_limit,
                                                              scale, kv_scale, max_context_len)
        attn = torch.bmm(out_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        return attn if out is None else out[..., : attn.shape[-1]].copy_(attn)
    rank = w_uk.shape[2]
    work = torch.promote_types(q.dtype, torch.float32)  # (float64 where the tests ask for it)
    attn = q.new_zeros(q.shape[0], q.shape[1], w_uv.shape[1])  # (padding rows: zeros)
    if prefill_index is not None:  # the torch path reads the index's sequences (they start at row 0, in order)
        query_lens = prefill_index.query_lens.tolist()[: prefill_index.pad_seq]  # unused ones: 0 queries
    block_size, start = cache.shape[1], 0
    for seq, (context_len, query_len) in enumerate(zip(context_lens.tolist(), query_lens)):
        if query_len == 0:
            continue
        blocks = block_tables[seq, : -(-context_len // block_size)].long()
        latent = cache[blocks].flatten(0, 1)[:context_len]
        latent = dequantize_kv(latent, kv_scale, work) if is_fp8(cache) else latent.to(work)
        c_kv, k_pe = latent.split([rank, latent.shape[-1] - rank], dim=-1)  # [context_len, rank], [.., rope]
        qn, qp = q_nope[start : start + query_len].to(work), q_pe[start : start + query_len].to(work)
        rope_scores = torch.einsum("qhd,kd->hqk", qp, k_pe)
        is_expanded = expand is not None and takes_expanded(query_len, context_len, form)
        if is_expanded:
            k_nope, v = expand(c_kv.to(q.dtype))
            scores = torch.einsum("qhd,khd->hqk", qn, k_nope.to(work)) + rope_scores
        else:
            q_lat = torch.einsum("qhn,hnr->qhr", qn, w_uk.to(work))
            scores = torch.einsum("qhr,kr->hqk", q_lat, c_kv) + rope_scores
        scores = scores * scale
        if query_len > 1:
            scores.masked_fill_(~_causal_mask(query_len, context_len, None, q.device), float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # [num_heads, query_len, context_len]
        if is_expanded:
            seq_attn = torch.einsum("hqk,khv->qhv", probs, v.to(work))
        else:
            seq_attn = torch.einsum("qhr,hvr->qhv", torch.einsum("hqk,kr->qhr", probs, c_kv), w_uv.to(work))
        attn[start : start + query_len] = seq_attn.to(q.dtype)
        start += query_len
    if out is None:
        return attn
    out[: attn.shape[0], :, : attn.shape[-1]] = attn
    return out[..., : attn.shape[-1]]


def row_index(query_lens: list[int], context_lens: Tensor, num_rows: int, index_cache: dict | None,
              prefill_index: PrefillIndex | None) -> tuple[Tensor, Tensor]:
    """(row_seq, row_limit) [num_rows] int32 on context_lens' device: each query row's sequence and how many of its
    keys it attends (its causal prefix: context - query_len + i + 1 for its i-th query; 0 for a padding row). Made
    once per step (index_cache, the ForwardBatch's). A decode step (query_lens all 1) and a prefill_index's step
    build them from device tensors alone (a CUDA graph captures them)."""
    cache = {} if index_cache is None else index_cache
    key = ("mla_rows", num_rows)
    if key in cache:
        return cache[key]
    device = context_lens.device
    if prefill_index is not None:
        index = prefill_index
        seq = index.block_seqs.long()  # [num_blocks]
        i = index.block_starts.long()[:, None] + torch.arange(index.queries_per_block, device=device)  # [blocks, Q]
        qlen = index.query_lens.long()[seq][:, None]
        rows = torch.where(i < qlen, index.first_rows.long()[seq][:, None] + i, num_rows).flatten()
        limit = (context_lens.long()[seq][:, None] - qlen + i + 1).int().flatten()
        row_seq = torch.full((num_rows + 1,), index.pad_seq, dtype=torch.int32, device=device)
        row_seq.scatter_(0, rows, seq.int()[:, None].expand_as(i).flatten())
        row_limit = torch.zeros(num_rows + 1, dtype=torch.int32, device=device).scatter_(0, rows, limit)
        cache[key] = row_seq[:num_rows], row_limit[:num_rows]
    elif all(n == 1 for n in query_lens):
        cache[key] = torch.arange(num_rows, dtype=torch.int32, device=device), context_lens[:num_rows].int()
    else:
        seqs = [s for s, n in enumerate(query_lens) for _ in range(n)]
        back = [i + 1 - n for n in query_lens for i in range(n)]  # context - query_len + i + 1, less the context
        row_seq = to_device(torch.tensor(seqs, dtype=torch.int32), device)
        delta = to_device(torch.tensor(back, dtype=torch.int32), device)
        cache[key] = row_seq, context_lens.int()[row_seq.long()] + delta
    return cache[key]
