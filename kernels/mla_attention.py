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
v) per key first, which pays back over many queries. Both devices run the expanded form through one function
(`expanded_attention`: torch's scaled_dot_product_attention over the context's expanded keys, causal with the queries
at the context's end, vLLM's lower-right mask for a chunk after cached tokens). On CUDA a step's sequences of many
queries (`cuda_expanded_sequences`) take it and the rest (decode rows, short chunks) the absorbed form in one Triton
kernel (mla_attention_triton.py: each query row over its causal prefix), both writing into one output; a step of a
whole-forward CUDA graph (a prefill_index) runs every row absorbed, as the expanded form sizes its tensors from host
lengths. On a CPU the torch code below picks a form per sequence by its queries against its context (takes_expanded,
measured).

An FP8 cache (float8_e4m3fn / e5m2) stores clamp(x / kv_scale) for c_kv and k_pe alike: one scale per layer (the
artifact's k_scale; vLLM's MLA cache has one too). Shapes as attention.py's (query_lens on the host; prefill_index:
a mixed CUDA graph's sequences from device tensors).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.nn.functional import scaled_dot_product_attention

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
# On CUDA a sequence takes the expanded form where its step computes at least CUDA_EXPAND_MIN_QUERIES queries, its
# queries times its context times num_heads reach CUDA_EXPAND_MIN_WORK, and its context times num_heads is at most
# CUDA_EXPAND_MAX_KEY_HEADS. Measured on an H200 (session 46, benchmarks/mla_prefill.py, bf16, the attention alone,
# absorbed ms / expanded ms): V2-Lite's 16 heads, prompts of 128 / 512 / 2048 / 8192 tokens 0.22 / 0.16 / 1.10 / 15.6
# against 0.39 / 0.48 / 0.46 / 2.75, a 512-query chunk after 4096 cached 1.08 against 0.61; V3's 128 heads, prompts of
# 128 / 512 / 2048 / 8192 0.19 / 0.65 / 8.1 / 121.8 against 0.41 / 0.43 / 1.40 / 21.5, the chunk 8.4 against 2.1. The
# expanded form wins from about 2^24 query-key-head products on (V2-Lite's 512-token prompt, 2^22: absorbed 3x
# faster; V3's, 2^25: expanded 1.5x); below, both take a few tenths of a millisecond, mostly launches. The key bound
# caps the expanded keys and values a step holds at once (about 900 bytes per key and head in bf16: ~0.9 GiB, which
# the memory profile does not reserve beyond its own prompt's): DeepSeek-V3's 128 heads expand chunks of contexts up
# to 8192 keys, V2-Lite's 16 up to 65536; longer contexts stay absorbed (vLLM expands them in workspace-sized chunks
# merged by their log-sum-exp, not done here).
CUDA_EXPAND_MIN_QUERIES = 128
CUDA_EXPAND_MIN_WORK = 2**24
CUDA_EXPAND_MAX_KEY_HEADS = 2**20
# The most num_heads * queries * keys scores one scaled_dot_product_attention call of the expanded form covers (2**28:
# 1 GiB of float32 where a backend materializes them, as torch's math path does; on a CPU every call takes it, the
# CPU's flash kernel needing v as wide as q and k, 128 against 192; CUDA's memory-efficient kernel takes the narrower
# v and holds no scores): longer steps split their queries into chunks, each against its causal prefix of the keys.
EXPAND_MAX_SCORES = 2**28


# The absorbed kernel's split (mla_attention_triton): one program per (query row, HEADS_PER_PROGRAM heads); where those
# programs are fewer than 2 per SM, each row's keys are split over partitions of at least MIN_PARTITION_KEYS keys, at
# most MAX_PARTITIONS. Here, beside the torch path, so that the memory plan (runtime/memory.py) sizes the split's
# buffers without importing triton.
HEADS_PER_PROGRAM = 16
MIN_PARTITION_KEYS = 256
MAX_PARTITIONS = 32


def num_partitions(num_programs: int, max_context_len: int, num_sms: int) -> int:
    """Partitions of the keys per row: 1 while the (row, head block) programs fill the GPU (2 per SM); else enough
    to, each of at least MIN_PARTITION_KEYS keys, at most MAX_PARTITIONS (a decode of few sequences and heads:
    DeepSeek-V2-Lite's 16 heads are one program per row). Depends on max_context_len, which a CUDA graph fixes
    (max_model_len)."""
    if num_programs >= 2 * num_sms:
        return 1
    by_keys = -(-max_context_len // MIN_PARTITION_KEYS)
    return max(1, min(by_keys, MAX_PARTITIONS, -(-2 * num_sms // num_programs)))


def absorbed_split_bytes(num_rows: int, num_heads: int, kv_lora_rank: int, max_context_len: int, num_sms: int,
                         dtype_bytes: int) -> int:
    """The most bytes one launch of the absorbed kernel over num_rows rows holds at once for its split, q in a dtype
    of dtype_bytes (0 where it does not split): each (partition, row, head)'s normalized float32 output of
    kv_lora_rank values, its max and sum; then in the merge by torch ops either two float32 temporaries per
    (partition, row, head) of the weights, or the weights, their total per (row, head), the merged float32 sum and
    its cast to q's dtype. A CUDA graph's pool keeps this once (each layer's launch frees it before the next
    allocates): runtime/memory.py plans it for the decode graphs (at max_model_len) and the whole-forward graphs
    (at their context bound)."""
    partitions = num_partitions(num_rows * -(-num_heads // HEADS_PER_PROGRAM), max_context_len, num_sms)
    if partitions == 1:
        return 0
    pairs, rows_heads = partitions * num_rows * num_heads, num_rows * num_heads
    merge = max(8 * pairs, 4 * pairs + rows_heads * (kv_lora_rank * (4 + dtype_bytes) + 4))
    return 4 * pairs * (kv_lora_rank + 2) + merge


def takes_expanded(query_len: int, context_len: int, form: str | None = None) -> bool:
    """Whether a sequence's step runs the expanded form on a CPU: `form` where given (FORMS), else the measured
    rule above."""
    if form is not None:
        return form == "expanded"
    return query_len >= max(1, min(EXPAND_MIN_QUERIES, context_len // EXPAND_KEYS_PER_QUERY))


def cuda_expanded_sequences(query_lens: list[int], context_lens: Callable[[], Sequence[int]], num_heads: int,
                            form: str | None = None) -> list[int]:
    """The sequences of a CUDA step that take the expanded form (the rest run the absorbed kernel): every one that
    computes queries where `form` is "expanded", none where "absorbed", else those of at least
    CUDA_EXPAND_MIN_QUERIES queries whose queries * context * num_heads reach CUDA_EXPAND_MIN_WORK and whose
    context is within CUDA_EXPAND_MAX_KEY_HEADS / num_heads keys.
    context_lens: the step's context lengths on the host, asked only where some sequence computes that many queries
    (reading them from the device waits for it)."""
    if form == "absorbed":
        return []
    if form == "expanded":
        return [seq for seq, n in enumerate(query_lens) if n > 0]
    many = [seq for seq, n in enumerate(query_lens) if n >= CUDA_EXPAND_MIN_QUERIES]
    if not many:
        return []
    lens = context_lens()
    return [seq for seq in many if CUDA_EXPAND_MIN_WORK <= query_lens[seq] * int(lens[seq]) * num_heads
            and int(lens[seq]) * num_heads <= CUDA_EXPAND_MAX_KEY_HEADS]


def expanded_attention(q: Tensor, k_nope: Tensor, k_pe: Tensor, v: Tensor, scale: float) -> Tensor:
    """One sequence's expanded-form attention: its queries q [n, num_heads, qk_nope + qk_rope] (the last n of its c
    context tokens) against k_nope [c, num_heads, qk_nope] (kv_b's), k_pe [c, qk_rope] (every head's) and v [c,
    num_heads, v_head_dim], causal lower-right (query i sees keys 0..c - n + i), softmax(q k^T * scale) v →
    [n, num_heads, v_head_dim], in the inputs' dtype. scaled_dot_product_attention per chunk of queries
    (EXPAND_MAX_SCORES): with is_causal where the chunk's keys are as many as its queries, else on CUDA torch's
    lower-right CausalBias (its memory-efficient kernel's own mask, none in memory; flash needs v as wide as q), on a
    CPU an explicit mask (CausalBias would build it there too, warning at every call)."""
    num_queries, num_heads = q.shape[:2]
    context = k_nope.shape[0]
    k = torch.cat((k_nope, k_pe[:, None, :].expand(-1, num_heads, -1)), dim=-1).transpose(0, 1)[None]  # [1, h, c, qk]
    v = v.transpose(0, 1)[None]  # [1, heads, c, v_head_dim]
    out = q.new_empty(num_queries, num_heads, v.shape[-1])
    chunk = max(1, EXPAND_MAX_SCORES // (num_heads * context))
    for first in range(0, num_queries, chunk):
        last = min(first + chunk, num_queries)
        keys = context - num_queries + last  # the chunk's causal prefix: its last query's own position, inclusive
        qc = q[first:last].transpose(0, 1)[None]  # [1, heads, queries, qk] (the fused kernels take 4 dims)
        kc, vc = k[:, :, :keys], v[:, :, :keys]
        if keys == last - first:
            attn = scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale)
        elif q.is_cuda:
            from torch.nn.attention.bias import causal_lower_right

            attn = scaled_dot_product_attention(qc, kc, vc, attn_mask=causal_lower_right(last - first, keys),
                                                scale=scale)
        else:
            mask = _causal_mask(last - first, keys, None, q.device)
            attn = scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=scale)
        out[first:last] = attn[0].transpose(0, 1)
    return out


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
    host_context_lens: Sequence[int] | None = None,
) -> Tensor:
    """Causal latent attention of each sequence's new queries over its cached latents.

    q [num_tokens, num_heads, qk_nope + qk_rope]: each head's q_nope, then its rotated q_pe. w_uk [num_heads, qk_nope,
    kv_lora_rank], w_uv [num_heads, v_head_dim, kv_lora_rank] in q's dtype. expand(c_kv [n, kv_lora_rank]) → (k_nope
    [n, num_heads, qk_nope], v [n, num_heads, v_head_dim]): the expanded form's kv_b (None: always absorbed). form:
    "absorbed" or "expanded" for every sequence; None: each by takes_expanded's rule on a CPU, by
    cuda_expanded_sequences' on CUDA (a prefill_index's step: absorbed always). max_context_len: at least every
    context_lens entry (a host value: CUDA splits long contexts of few rows by it; None: no split).
    host_context_lens: context_lens on the host where the caller has them (CUDA's expanded sequences are sized by
    them; None: read from the device once per step where needed). Returns [num_tokens, num_heads, v_head_dim]
    (into out[..., :v_head_dim] when given)."""
    if can_use_triton(q, cache):
        return cuda_mla_attention(q, cache, w_uk, w_uv, block_tables, context_lens, query_lens, scale, kv_scale,
                                   max_context_len, expand, form, index_cache, prefill_index, out, host_context_lens)
    nope, rank = w_uk.shape[1], w_uk.shape[2]
    q_nope, q_pe = q.split([nope, q.shape[-1] - nope], dim=-1)
    work = torch.promote_types(q.dtype, torch.float32)  # (float64 where the tests ask for it)
    attn = q.new_zeros(q.shape[0], q.shape[1], w_uv.shape[1])  # (padding rows: zeros)
    if prefill_index is not None:  # the torch path reads the index's sequences (they start at row 0, in order)
        query_lens = prefill_index.query_lens.tolist()[: prefill_index.pad_seq]  # unused ones: 0 queries
    start = 0
    for seq, (context_len, query_len) in enumerate(zip(context_lens.tolist(), query_lens)):
        if query_len == 0:
            continue
        rows = slice(start, start + query_len)
        start += query_len
        latent = _sequence_latent(cache, block_tables, seq, context_len, kv_scale, work)
        if expand is not None and takes_expanded(query_len, context_len, form):
            attn[rows] = _expanded_sequence(q[rows].to(work), latent, rank, expand, scale, q.dtype).to(q.dtype)
            continue
        c_kv, k_pe = latent.split([rank, latent.shape[-1] - rank], dim=-1)  # [context_len, rank], [.., rope]
        qn, qp = q_nope[rows].to(work), q_pe[rows].to(work)
        q_lat = torch.einsum("qhn,hnr->qhr", qn, w_uk.to(work))
        scores = (torch.einsum("qhr,kr->hqk", q_lat, c_kv) + torch.einsum("qhd,kd->hqk", qp, k_pe)) * scale
        if query_len > 1:
            scores.masked_fill_(~_causal_mask(query_len, context_len, None, q.device), float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # [num_heads, query_len, context_len]
        seq_attn = torch.einsum("qhr,hvr->qhv", torch.einsum("hqk,kr->qhr", probs, c_kv), w_uv.to(work))
        attn[rows] = seq_attn.to(q.dtype)
    if out is None:
        return attn
    out[: attn.shape[0], :, : attn.shape[-1]] = attn
    return out[..., : attn.shape[-1]]


def _sequence_latent(cache: Tensor, block_tables: Tensor, seq: int, context_len: int, kv_scale: float,
                     dtype: torch.dtype) -> Tensor:
    """Sequence seq's cached [c_kv, k_pe] [context_len, kv_lora_rank + qk_rope] in dtype (an FP8 cache's times its
    scale)."""
    block_size = cache.shape[1]
    blocks = block_tables[seq, : -(-context_len // block_size)].long()
    latent = cache[blocks].flatten(0, 1)[:context_len]
    return dequantize_kv(latent, kv_scale, dtype) if is_fp8(cache) else latent.to(dtype)


def _expanded_sequence(q: Tensor, latent: Tensor, rank: int, expand: Callable[[Tensor], tuple[Tensor, Tensor]],
                       scale: float, expand_dtype: torch.dtype) -> Tensor:
    """One sequence's expanded form: kv_b over its latents [context_len, rank + rope] (in expand_dtype, the model's),
    then expanded_attention in q's dtype."""
    c_kv, k_pe = latent.split([rank, latent.shape[-1] - rank], dim=-1)
    k_nope, v = expand(c_kv.to(expand_dtype).contiguous())
    return expanded_attention(q, k_nope.to(q.dtype), k_pe.to(q.dtype), v.to(q.dtype), scale)


def cuda_mla_attention(q, cache, w_uk, w_uv, block_tables, context_lens, query_lens, scale, kv_scale,
                       max_context_len, expand, form, index_cache, prefill_index, out, host_context_lens) -> Tensor:
    """mla_attention on CUDA (its arguments; on CPU tensors the kernel runs in Triton's interpreter: tests): the
    expanded sequences (cuda_expanded_sequences) one by one, the other rows through the absorbed Triton kernel, into
    one output."""
    from . import mla_attention_triton  # triton loads on the first CUDA call only

    nope, rank, num_rows = w_uk.shape[1], w_uk.shape[2], q.shape[0]
    expanded, absorbed_rows = _cuda_route(query_lens, context_lens, num_rows, q.shape[1], expand is not None, form,
                                          index_cache, prefill_index, host_context_lens)

    def absorbed(q_rows: Tensor, row_seq: Tensor, row_limit: Tensor) -> Tensor:
        q_nope, q_pe = q_rows.split([nope, q.shape[-1] - nope], dim=-1)
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [rows, num_heads, kv_lora_rank]
        out_lat = mla_attention_triton.mla_absorbed_attention(q_lat, q_pe, cache, block_tables, row_seq, row_limit,
                                                              scale, kv_scale, max_context_len)
        return torch.bmm(out_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    if absorbed_rows is None:  # every row absorbed (decode steps, graphs)
        attn = absorbed(q, *row_index(query_lens, context_lens, num_rows, index_cache, prefill_index))
        return attn if out is None else out[..., : attn.shape[-1]].copy_(attn)
    attn = q.new_empty(num_rows, q.shape[1], w_uv.shape[1]) if out is None else out[..., : w_uv.shape[1]]
    if absorbed_rows.numel():
        row_seq, row_limit = row_index(query_lens, context_lens, num_rows, index_cache, prefill_index)
        attn.index_copy_(0, absorbed_rows, absorbed(q[absorbed_rows], row_seq[absorbed_rows],
                                                    row_limit[absorbed_rows]))
    for seq, first, context_len in expanded:
        rows = slice(first, first + query_lens[seq])
        latent = _sequence_latent(cache, block_tables, seq, context_len, kv_scale, q.dtype)
        attn[rows] = _expanded_sequence(q[rows], latent, rank, expand, scale, q.dtype)
    return attn


def _cuda_route(query_lens: list[int], context_lens: Tensor, num_rows: int, num_heads: int, can_expand: bool,
                form: str | None, index_cache: dict | None, prefill_index: PrefillIndex | None,
                host_context_lens: Sequence[int] | None) -> tuple[list[tuple[int, int, int]], Tensor | None]:
    """A CUDA step's split, made once per step (index_cache): [(seq, first row, context_len)] of its expanded
    sequences, and the absorbed rows as a device index (None: every row; a graph's step, whose query_lens are its
    captured size, is all absorbed)."""
    cache = {} if index_cache is None else index_cache
    key = ("mla_route", num_rows)
    if key in cache:
        return cache[key]
    lens: list[int] = []

    def host_lens() -> list[int]:
        if not lens:  # (a device read: only where some sequence may expand)
            lens.extend(context_lens.tolist() if host_context_lens is None else host_context_lens)
        return lens

    expanded = [] if not can_expand or prefill_index is not None else cuda_expanded_sequences(
        query_lens, host_lens, num_heads, form)
    if not expanded:
        cache[key] = [], None
        return cache[key]
    firsts = [0, *itertools.accumulate(query_lens)][:-1]  # each sequence's first row (as attention_triton's)
    chosen = set(expanded)
    rows = [row for seq, n in enumerate(query_lens) if seq not in chosen for row in range(firsts[seq], firsts[seq] + n)]
    absorbed = to_device(torch.tensor(rows, dtype=torch.long), context_lens.device)
    cache[key] = [(seq, firsts[seq], int(host_lens()[seq])) for seq in expanded], absorbed
    return cache[key]


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
