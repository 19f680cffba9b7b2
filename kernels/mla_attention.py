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
(`expanded_attention`: the context expanded in chunks of at most EXPAND_MAX_KEY_HEADS / num_heads keys, each chunk
attended by the queries that see it, unmasked or causal lower-right where it holds their own positions, the chunks'
outputs merged by their log-sum-exps in float32, as vLLM's chunked MLA prefill; one attention call per chunk and
block of queries, `attend`: torch's memory-efficient kernel on CUDA, which returns the log-sum-exp, matmuls on a
CPU). On CUDA a step's sequences of many queries (`cuda_expanded_sequences`) take it and the rest (decode rows, short
chunks) the absorbed form in one Triton kernel (mla_attention_triton.py: each query row over its causal prefix), both
writing into one output; a step of a whole-forward CUDA graph (a prefill_index) runs every row absorbed, as the
expanded form sizes its tensors from host lengths. On a CPU the torch code below picks a form per sequence by its
queries against its context (takes_expanded, measured).

An FP8 cache (float8_e4m3fn / e5m2) stores clamp(x / kv_scale) for c_kv and k_pe alike: one scale per layer (the
artifact's k_scale; vLLM's MLA cache has one too). Shapes as attention.py's (query_lens on the host; prefill_index:
a mixed CUDA graph's sequences from device tensors).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from . import can_use_triton, to_device
from .attention import PrefillIndex, _causal_mask, is_fp8, quantize_kv

# On a CPU a sequence takes the expanded form where its step computes at least min(EXPAND_MIN_QUERIES, context //
# EXPAND_KEYS_PER_QUERY) queries (at least 1), else the absorbed form. The expanded form pays kv_b over the whole
# context once (num_heads * (qk_nope + v) * kv_lora_rank per key), the absorbed one about num_heads * 700 more per
# query and key at V2-Lite's shape: even at some 190 queries by count. Measured (benchmarks/mla_forms.py, 2 shared
# CPU cores, V2-Lite's 16 heads, float32 and bfloat16): at 2048 keys absorbed up to 64 queries, expanded at 256; at
# 256 keys expanded from 16 queries on (torch's per-call costs), either within noise below.
EXPAND_MIN_QUERIES = 128
EXPAND_KEYS_PER_QUERY = 16
FORMS = ("absorbed", "expanded")
# On CUDA a sequence takes the expanded form where its step computes at least CUDA_EXPAND_MIN_QUERIES queries and its
# queries times its context times num_heads reach CUDA_EXPAND_MIN_WORK. Measured on an H200 (session 46,
# benchmarks/mla_prefill.py, bf16, the attention alone, absorbed ms / expanded ms): V2-Lite's 16 heads, prompts of 128 /
# 512 / 2048 / 8192 tokens 0.22 / 0.16 / 1.10 / 15.6 against 0.39 / 0.48 / 0.46 / 2.75, a 512-query chunk after 4096
# cached 1.08 against 0.61; V3's 128 heads, prompts of 128 / 512 / 2048 / 8192 0.19 / 0.65 / 8.1 / 121.8 against 0.41 /
# 0.43 / 1.40 / 21.5, the chunk 8.4 against 2.1. The expanded form wins from about 2^24 query-key-head products on
# (V2-Lite's 512-token prompt, 2^22: absorbed 3x faster; V3's, 2^25: expanded 1.5x); below, both take a few tenths of a
# millisecond, mostly launches. (Session 46 also bounded the context at 2^20 / num_heads keys, as the whole context was
# expanded at once; it is now expanded in chunks, below, so no context is too long.)
CUDA_EXPAND_MIN_QUERIES = 128
CUDA_EXPAND_MIN_WORK = 2**24
# The expanded form expands a sequence's context in chunks of at most EXPAND_MAX_KEY_HEADS / num_heads keys, and at
# most EXPAND_MAX_KEYS (on both devices): kv_b's output, the keys and the values of one chunk at a time, about 900 bytes
# per key and head in bf16 beside the chunk's latents and kv_b's input (~1 GiB, which the memory plan holds back:
# expanded_bytes), whatever the context (DeepSeek-V3's 128 heads: chunks of 8192 keys, V2-Lite's 16 or a V3 rank of
# 16 heads: 65536; the key bound keeps the latents of a rank of few heads within ~140 MiB). Each chunk's attention
# returns its output and log-sum-exp per query and head; the chunks' outputs merge exactly by their log-sum-exps
# (vLLM's chunked MLA prefill, merge_attn_states).
EXPAND_MAX_KEY_HEADS = 2**20
EXPAND_MAX_KEYS = 2**16
# The most num_heads * queries * keys scores one attention call of the expanded form covers: the queries a chunk's
# call attends split into blocks within it. On a CPU 2**28 (1 GiB of float32: its matmuls materialize them). CUDA's
# memory-efficient kernel holds none, so there the blocks only trade calls and merges for the partial outputs'
# memory: 2**31, measured on an H200 (session 47, benchmarks/results/session47/call4.sh) against 2**28 and 2**40:
# V2-Lite's 512-query chunk after 32768 cached 3.43 → 2.19 ms, V3's 8192-token prompt 22.1 → 21.0 ms (2**40 no
# faster anywhere, its peak up to 580 MiB higher at V3's 16384).
EXPAND_MAX_SCORES = 2**28
CUDA_EXPAND_MAX_SCORES = 2**31


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


def expanded_bytes(num_queries: int, num_heads: int, qk_nope: int, qk_rope: int, v_dim: int, kv_lora_rank: int,
                   dtype_bytes: int, max_context: int | None = None) -> int:
    """The most bytes expanded_attention allocates at once on CUDA for one sequence of num_queries queries over a
    context of at least a chunk (expand_chunk_keys) in a dtype of dtype_bytes, beyond q and the step's output: the
    queries' running output and log-sum-exp (float32), beside either a chunk's tensors (its latents gathered from the
    cache in the dtype, an FP8 cache's converted from its gather, which is freed before kv_b runs; kv_b's output of
    qk_nope + v per head, a dense kv_b's; then kv_b's input, c_kv contiguous, while it runs, or after it the keys
    [k_nope, k_pe] of qk_nope + qk_rope per head beside one call's: its rows' partial output, its log-sum-exp of rows
    padded to 32, the merge's six float32 temporaries per row and head), or the running output cast to the dtype at
    the end. A context of at most max_context keys (max_model_len; None: unbounded) expands chunks of at most that
    many. The memory plan holds it back (runtime/memory.py: mla_expanded_bytes)."""
    keys = expand_chunk_keys(num_heads) if max_context is None else min(expand_chunk_keys(num_heads), max_context)
    rows = min(num_queries, max(1, CUDA_EXPAND_MAX_SCORES // (num_heads * keys)))
    latent = keys * (kv_lora_rank + qk_rope) * dtype_bytes
    kv_b = keys * num_heads * (qk_nope + v_dim) * dtype_bytes
    call = rows * num_heads * (v_dim * dtype_bytes + 6 * 4) + num_heads * -(-rows // 32) * 32 * 4
    chunk = latent + kv_b + max(keys * kv_lora_rank * dtype_bytes, keys * num_heads * (qk_nope + qk_rope) * dtype_bytes
                                + call)
    running = num_queries * num_heads * (v_dim + 1) * 4
    return running + max(chunk, num_queries * num_heads * v_dim * dtype_bytes)


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
    CUDA_EXPAND_MIN_QUERIES queries whose queries * context * num_heads reach CUDA_EXPAND_MIN_WORK, however long
    their context (expanded_attention expands it in chunks).
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
    return [seq for seq in many if CUDA_EXPAND_MIN_WORK <= query_lens[seq] * int(lens[seq]) * num_heads]


def expand_chunk_keys(num_heads: int) -> int:
    """The most keys of a context the expanded form expands at once: EXPAND_MAX_KEY_HEADS / num_heads, at most
    EXPAND_MAX_KEYS (at least 1)."""
    return max(1, min(EXPAND_MAX_KEY_HEADS // num_heads, EXPAND_MAX_KEYS))


def expanded_attention(q: Tensor, latents: Callable[[int, int], Tensor], context_len: int, rank: int,
                       expand: Callable[[Tensor], tuple[Tensor, Tensor]], scale: float,
                       expand_dtype: torch.dtype) -> Tensor:
    """One sequence's expanded-form attention: its queries q [n, num_heads, qk_nope + qk_rope] (the last n of its
    context_len tokens; query i sees keys 0..context_len - n + i) → softmax(q k^T * scale) v [n, num_heads,
    v_head_dim] in q's dtype. The context is expanded in chunks of expand_chunk_keys(num_heads) keys: latents(first,
    last) → the cached [c_kv, k_pe] [last - first, rank + rope] in q's dtype; kv_b over its c_kv (`expand`, in
    expand_dtype, the model's) → k_nope, v; the keys [k_nope, k_pe every head's]. Each chunk is attended by the
    queries that see any of it, in blocks of queries within (CUDA_)EXPAND_MAX_SCORES (_chunk_calls: unmasked where the
    queries see the whole chunk, causal lower-right where the chunk holds their own positions), each call's output
    and log-sum-exp merged into a running output (merge_partial, float32 or q's wider dtype)."""
    num_queries, num_heads = q.shape[:2]
    work = torch.promote_types(q.dtype, torch.float32)
    out = lse = None
    chunk = expand_chunk_keys(num_heads)
    for start in range(0, context_len, chunk):
        out, lse = _attend_chunk(q, latents(start, min(start + chunk, context_len)), start, context_len - num_queries,
                                 rank, expand, scale, expand_dtype, out, lse, work)
    return out.to(q.dtype)


def _attend_chunk(q: Tensor, latent: Tensor, start: int, first_position: int, rank: int,
                  expand: Callable[[Tensor], tuple[Tensor, Tensor]], scale: float, expand_dtype: torch.dtype,
                  out: Tensor | None, lse: Tensor | None, work: torch.dtype) -> tuple[Tensor, Tensor]:
    """expanded_attention's chunk of keys at positions start.. (latent [keys, rank + rope]) attended and merged into
    the running (out [n, heads, v] in work, lse [n, heads] float32 or work), made at the first chunk, whose calls
    are each row's first part (copied, not merged: a context within one chunk merges nothing). Its own function, so
    that a chunk's tensors are freed before the next chunk's are made."""
    num_heads = q.shape[1]
    c_kv, k_pe = latent.split([rank, latent.shape[-1] - rank], dim=-1)
    k_nope, v = expand(c_kv.to(expand_dtype).contiguous())
    k = torch.cat((k_nope.to(q.dtype), k_pe[:, None, :].expand(-1, num_heads, -1)), dim=-1)  # [keys, heads, qk]
    v = v.to(q.dtype)
    first_chunk = out is None  # (every query sees key 0: the first chunk's calls give each row its first part)
    if first_chunk:
        out = torch.empty(q.shape[0], num_heads, v.shape[-1], dtype=work, device=q.device)
        lse = torch.empty(q.shape[0], num_heads, dtype=work, device=q.device)
    max_scores = EXPAND_MAX_SCORES if q.device.type == "cpu" else CUDA_EXPAND_MAX_SCORES
    for rows, keys, lower_right in _chunk_calls(q.shape[0], first_position, start, k.shape[0], num_heads, max_scores):
        merge_partial(out, lse, rows, *attend(q[rows], k[:keys], v[:keys], scale, lower_right), first=first_chunk)
    return out, lse


def _chunk_calls(num_queries: int, first_position: int, start: int, num_keys: int, num_heads: int,
                 max_scores: int) -> list[tuple[slice, int, bool]]:
    """The attention calls of one chunk of keys (positions start..start + num_keys - 1) for queries at positions
    first_position..: (query rows, the chunk's first keys they read, causal lower-right) per call. Queries go in
    blocks of at most max_scores / (num_heads * num_keys); in a block, the queries before the chunk see none
    of it, those within it (their own positions) see its keys up to theirs (lower-right over the keys up to the
    last of them), those after it all of it (unmasked)."""
    calls = []
    end = start + num_keys
    block = max(1, max_scores // (num_heads * num_keys))
    for first in range(0, num_queries, block):
        low, high = first_position + first, first_position + min(first + block, num_queries)  # positions [low, high)
        seen, inside = max(low, start), min(high, end)  # the first position seeing the chunk; past the diagonal
        if seen < inside:
            calls.append((slice(seen - first_position, inside - first_position), inside - start, True))
        if max(seen, end) < high:
            calls.append((slice(max(seen, end) - first_position, high - first_position), num_keys, False))
    return calls


def attend(q: Tensor, k: Tensor, v: Tensor, scale: float, lower_right: bool) -> tuple[Tensor, Tensor]:
    """Attention of q [n, heads, qk] over k [keys, heads, qk], v [keys, heads, v_dim] (unmasked, or causal
    lower-right: query i sees keys 0..keys - n + i; n <= keys) → (output [n, heads, v_dim], log-sum-exp of the
    scaled scores [n, heads], float32 or wider). On CUDA torch's memory-efficient kernel, which returns the
    log-sum-exp (custom_mask_type 2 is its lower-right mask; rows padded to 32 in it; its meta kernel on meta tensors,
    which the memory plan's test measures); on a CPU matmuls in q's dtype (float32 or wider there)."""
    if q.device.type != "cpu":
        out, lse = torch.ops.aten._efficient_attention_forward(
            q[None], k[None], v[None], None, None, None, None, None, 0.0, 2 if lower_right else 0, True,
            scale=scale)[:2]
        return out[0], lse[0, :, : q.shape[0]].transpose(0, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if lower_right:
        scores.masked_fill_(~_causal_mask(q.shape[0], k.shape[0], None, q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [heads, n]
    probs = torch.exp(scores.sub_(lse[..., None]))
    return torch.einsum("hqk,khv->qhv", probs, v), lse.transpose(0, 1)


def merge_partial(out: Tensor, lse: Tensor, rows: slice, part: Tensor, part_lse: Tensor, first: bool = False) -> None:
    """Merge one call's normalized output part [n, heads, v] and its log-sum-exp part_lse [n, heads] into the
    running out / lse of the rows, in place (out's dtype, float32 or wider): with m the larger log-sum-exp, the
    weights exp(lse - m) and exp(part_lse - m), out = (out * w + part * w_part) / (w + w_part), lse = m + log(w +
    w_part). first: the rows' first part, copied (the running tensors hold nothing there yet)."""
    if first:
        out[rows], lse[rows] = part, part_lse
        return
    old = lse[rows]
    top = torch.maximum(old, part_lse)
    weight, part_weight = torch.exp(old - top), torch.exp(part_lse - top)
    total = weight + part_weight
    out[rows].mul_((weight / total)[..., None]).addcmul_(part, (part_weight / total)[..., None])
    lse[rows] = top + torch.log(total)


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
        if expand is not None and takes_expanded(query_len, context_len, form):
            attn[rows] = expanded_attention(q[rows].to(work), _latents_of(cache, block_tables, seq, kv_scale, work),
                                            context_len, rank, expand, scale, q.dtype).to(q.dtype)
            continue
        latent = _sequence_latent(cache, block_tables, seq, 0, context_len, kv_scale, work)
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


def _sequence_latent(cache: Tensor, block_tables: Tensor, seq: int, first: int, last: int, kv_scale: float,
                     dtype: torch.dtype) -> Tensor:
    """Sequence seq's cached [c_kv, k_pe] of the keys at positions first..last - 1 [last - first, kv_lora_rank +
    qk_rope] in dtype (an FP8 cache's times its scale: converted to dtype, exactly, then scaled in it, which rounds
    as attention.dequantize_kv's float32 product does in float32 and narrower dtypes, without its float32 copies)."""
    block_size = cache.shape[1]
    blocks = block_tables[seq, first // block_size : -(-last // block_size)].long()
    latent = cache[blocks].flatten(0, 1)[first % block_size :][: last - first]
    return latent.to(dtype).mul_(kv_scale) if is_fp8(cache) else latent.to(dtype)


def _latents_of(cache: Tensor, block_tables: Tensor, seq: int, kv_scale: float,
                dtype: torch.dtype) -> Callable[[int, int], Tensor]:
    """expanded_attention's latents(first, last) of sequence seq."""
    return lambda first, last: _sequence_latent(cache, block_tables, seq, first, last, kv_scale, dtype)


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
        attn[rows] = expanded_attention(q[rows], _latents_of(cache, block_tables, seq, kv_scale, q.dtype),
                                        context_len, rank, expand, scale, q.dtype)
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
