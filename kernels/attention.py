"""Attention over the paged KV cache, and the KV-cache write by slot mapping (with the rotary
embedding of q and k before it: one kernel on CUDA).

The cache of one layer is two tensors [num_blocks, block_size, num_kv_heads, head_dim]. A sequence's
tokens live in the blocks its block table lists; token t of the sequence is at slot
block_table[t // block_size] * block_size + t % block_size.

Shapes, for a step with num_seqs sequences and num_tokens query tokens in all:
  q                [num_tokens, num_heads, head_dim]   the queries of every sequence, concatenated
  block_tables     [num_seqs, max_num_blocks] int32     padded rows; only the first ceil(ctx/bs) are read
  context_lens     [num_seqs] int32, on q's device      tokens in the cache per sequence, this step's included
  query_lens       list[int] (num_seqs), on the host     this step's tokens per sequence (the last of the context)
  max_context_len  int, on the host                     a bound on context_lens (sizes the decode split)

FP8 KV cache (k_cache/v_cache of dtype float8_e4m3fn or float8_e5m2): the write stores
clamp(x / scale) in FP8, attention reads scale * x8, one scale per layer for K and one for V (host
floats: a CUDA graph freezes them, and they never change after load). Other cache dtypes ignore the
scales (they must be 1.0).

Only query_lens and max_context_len are host values, and a step whose query_lens are all 1 builds
no tensor from them: such a step (a decode step) can be captured in a CUDA graph.

On CUDA `paged_attention` and `rotate_and_write_kv` run the Triton kernels of attention_triton.py
(decode, prefill / chunked prefill; rotary + KV write; `rotate_write_and_attend` does both, in the
decode kernel alone for a decode step); elsewhere the plain-torch code below (`write_kv_cache` is its
write), which is also the kernels' test oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import can_use_triton
from .rotary import apply_rotary

PARTITION_SIZE = 512  # decode: the most keys per partition when contexts are split
MIN_PARTITION_SIZE = 64  # ... and the fewest (one bf16 key tile, attention_triton.DECODE_BLOCK_N)
MAX_PARTITIONS = 64  # partitions shrink below PARTITION_SIZE only while max_context_len needs at most this many
# A split decode merges its partitions in the decode kernel (the last partition of each (sequence,
# KV head) to finish) from this many pairs on, else in a second kernel (always the second kernel
# where a CUDA graph capture finds no semaphores, split_k_triton.tile_counters). Session 17 (H200,
# the attention of 32 8B-shaped layers at 129-384-token contexts) had the second kernel 7% faster at
# 16 pairs and set 32; with the rotary and KV write in the decode kernel (session 20, H100, two
# calls) the kernel's own merge was as fast or faster at every batch: 5% at 1 and 4 sequences, 0.3-1.4%
# at 2, 14-18% at 8 and 16 (benchmarks/RESULTS.md).
MERGE_IN_KERNEL_MIN_PAIRS = 1
PREFILL_BLOCK_ROWS = 64  # prefill kernel: (query, head) rows per program (attention_triton)
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class PrefillIndex:
    """Every sequence of a step sent to the prefill kernel from device tensors alone, in a grid that
    the buffers' sizes fix: what a CUDA graph of a mixed step holds (runtime/mixed_graphs.py), where
    query_lens cannot plan the grid on the host. Decode rows are sequences of one query here.

    Sequence `pad_seq` (the last entry of query_lens and first_rows, with context_lens 0) is the
    padding sequence: the blocks a step does not use point at it, and its programs read nothing and
    write nothing. context_lens must have pad_seq + 1 entries; out's rows that no block covers (a
    padded step's padding rows) keep what they held."""

    query_lens: Tensor  # [pad_seq + 1] int32: tokens computed this step, per sequence
    first_rows: Tensor  # [pad_seq + 1] int32: each sequence's first query row
    block_seqs: Tensor  # [num_blocks] int32: the sequence of each program's block of queries
    block_starts: Tensor  # [num_blocks] int32: its first query, counted within the sequence
    queries_per_block: int
    out: Tensor  # [>= num_tokens, num_heads, head_dim]: the attention's output buffer

    @property
    def pad_seq(self) -> int:
        return self.query_lens.shape[0] - 1


def prefill_queries_per_block(group: int) -> int:
    """Queries per program of the prefill kernel for `group` query heads per KV head."""
    return max(PREFILL_BLOCK_ROWS, 1 << (group - 1).bit_length()) // group


def prefill_blocks(query_lens: list[int], queries_per_block: int) -> list[tuple[int, int]]:
    """(sequence, first query) of each program of the prefill kernel over these sequences."""
    return [(seq, start) for seq, n in enumerate(query_lens) for start in range(0, n, queries_per_block)]


def max_prefill_blocks(num_tokens: int, num_seqs: int, queries_per_block: int) -> int:
    """The most blocks prefill_blocks gives for at most num_tokens tokens in at most num_seqs
    sequences: sum(ceil(n_i / q)) < sum(n_i) / q + num_seqs."""
    return num_tokens // queries_per_block + min(num_seqs, num_tokens)


def is_fp8(t: Tensor) -> bool:
    return t.dtype in FP8_KV_DTYPES


def quantize_kv(x: Tensor, scale: float, dtype: torch.dtype) -> Tensor:
    """x / scale (as x times float32(1 / scale), like the write kernel), saturated to dtype's finite
    range, rounded to the nearest FP8 value."""
    limit = torch.finfo(dtype).max
    return (x.float() * (1.0 / scale)).clamp(-limit, limit).to(dtype)


def dequantize_kv(x: Tensor, scale: float, dtype: torch.dtype = torch.float32) -> Tensor:
    return (x.float() * scale).to(dtype)


def decode_split(num_programs: int, max_context_len: int, num_sms: int) -> tuple[int, int]:
    """(partitions, keys per partition) the decode kernel splits max_context_len keys into, for
    num_programs (sequence, KV head) pairs. Unsplit, (1, max_context_len), while the pairs alone fill
    the GPU (2 programs per SM). Otherwise partitions of PARTITION_SIZE keys, halved while the pairs
    times the partitions of PARTITION_SIZE keys each would hold stay under 2 programs per SM, down to
    MIN_PARTITION_SIZE, and only while max_context_len then needs at most MAX_PARTITIONS of them: a
    few sequences' keys are read by many programs, a key tile or two each, not by one program per KV
    head looping over all of them. Partitions past a sequence's context are empty and cost no loads
    (attention_triton). The split does not depend on max_context_len up to MAX_PARTITIONS partitions
    of the pairs' size (a CUDA graph's bound, max_model_len, and an eager step's longest context then
    split a sequence's keys at the same boundaries)."""
    if num_programs < 2 * num_sms:
        size = PARTITION_SIZE
        while (size > MIN_PARTITION_SIZE and num_programs * (PARTITION_SIZE // size) < 2 * num_sms
               and -(-max_context_len // (size // 2)) <= MAX_PARTITIONS):
            size //= 2
        num_partitions = -(-max_context_len // size)
        if num_partitions > 1:
            return num_partitions, size
    return 1, max_context_len


def eager_decode_cases(num_kv_heads: int, max_model_len: int, num_sms: int) -> list[tuple[int, int]]:
    """(decode rows, max_context_len) of steps that together launch every decode-attention kernel
    variant an eager step (decodes beside prefill rows) can take: unsplit; split, merged by the second
    kernel (below MERGE_IN_KERNEL_MIN_PAIRS pairs); split, merged in the decode kernel. A server runs
    one forward of each at start (runtime/cuda_graphs.compile_mixed_step), so that no step compiles
    one while serving."""
    cases = [(1, min(MIN_PARTITION_SIZE, max_model_len))]
    for rows in (1, -(-MERGE_IN_KERNEL_MIN_PAIRS // num_kv_heads)):
        if decode_split(rows * num_kv_heads, max_model_len, num_sms)[0] > 1 and (rows, max_model_len) not in cases:
            cases.append((rows, max_model_len))
    return cases


def _rotary_kernels_apply(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, cos_sin_cache: Tensor) -> bool:
    """The Triton kernels rotate q, k, v in place or in registers: CUDA, unit stride along head_dim, and a table
    as wide as the heads (they rotate whole heads; a partial rotary's narrower table takes the torch rotation,
    e.g. a build's calibration on a GPU; the engine refuses such an artifact on CUDA, rotary.check_rotary_device)."""
    return (can_use_triton(q, k_cache) and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
            and cos_sin_cache.shape[-1] == q.shape[-1])


def rotate_and_write_kv(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos_sin_cache: Tensor, k_cache: Tensor,
                        v_cache: Tensor, slot_mapping: Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
                        q_out: Tensor | None = None) -> Tensor:
    """Rotary embedding of this step's q and k (kernels.rotary's convention), then its keys and
    values ([num_tokens, num_kv_heads, head_dim]) stored at their slots (quantized with k_scale /
    v_scale into an FP8 cache). Returns the rotated q ([num_tokens, num_heads, head_dim]), written
    into q_out when given (the piecewise graphs' static buffer: no copy after); callers read neither
    q nor k again. On CUDA one kernel does both (q rotated in place, or into q_out): a decode step
    launches one kernel per layer for them, not two."""
    if _rotary_kernels_apply(q, k, v, k_cache, cos_sin_cache) and (q_out is None or q_out.stride(-1) == 1):
        from . import attention_triton  # triton loads on the first CUDA call only

        return attention_triton.rotate_and_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
                                                    k_scale, v_scale, q_out)
    q, k = apply_rotary(q, k, positions, cos_sin_cache)
    write_kv_cache(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q if q_out is None else q_out.copy_(q)


def rotate_write_and_attend(
    q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos_sin_cache: Tensor, k_cache: Tensor, v_cache: Tensor,
    slot_mapping: Tensor, block_tables: Tensor, context_lens: Tensor, query_lens: list[int], scale: float,
    sliding_window: int | None = None, max_context_len: int | None = None, k_scale: float = 1.0,
    v_scale: float = 1.0, index_cache: dict | None = None, prefill_index: PrefillIndex | None = None,
    softcap: float | None = None, key_limits: Tensor | None = None, sinks: Tensor | None = None,
    attention_chunk_size: int | None = None,
) -> Tensor:
    """rotate_and_write_kv, then paged_attention (arguments as theirs); q and k are not read after.
    On CUDA a step whose query_lens are all 1 (a decode step) does both in the decode kernel: one
    kernel a layer instead of two, the same bits (attention_triton._decode_kernel, ROTATE)."""
    # the device check first: a CPU step does not scan query_lens in every layer
    if (prefill_index is None and key_limits is None and _rotary_kernels_apply(q, k, v, k_cache, cos_sin_cache)
            and query_lens and max(query_lens) == 1):
        from . import attention_triton

        return attention_triton.paged_attention(
            q, k_cache, v_cache, block_tables, context_lens, query_lens, scale, sliding_window, max_context_len,
            k_scale=k_scale, v_scale=v_scale, index_cache=index_cache,
            rotary=(k, v, positions, cos_sin_cache, slot_mapping), softcap=softcap, sinks=sinks,
            attention_chunk_size=attention_chunk_size,
        )
    q = rotate_and_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return paged_attention(q, k_cache, v_cache, block_tables, context_lens, query_lens, scale, sliding_window,
                           max_context_len, k_scale, v_scale, index_cache, prefill_index=prefill_index,
                           softcap=softcap, key_limits=key_limits, sinks=sinks,
                           attention_chunk_size=attention_chunk_size)


def write_kv_cache(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                   k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store keys and values ([num_tokens, num_kv_heads, head_dim]) at their slots (quantized with
    k_scale / v_scale into an FP8 cache): the torch write (`rotate_and_write_kv` on CUDA)."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    for x, cache, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        if is_fp8(cache):  # index_copy_ has no FP8 kernel on CPUs: copy the bytes
            x, cache = quantize_kv(x, scale, cache.dtype).view(torch.uint8), cache.view(torch.uint8)
        cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slot_mapping, x)


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    query_lens: list[int],
    scale: float,
    sliding_window: int | None = None,
    max_context_len: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    index_cache: dict | None = None,
    out: Tensor | None = None,
    prefill_index: PrefillIndex | None = None,
    softcap: float | None = None,
    key_limits: Tensor | None = None,
    sinks: Tensor | None = None,
    attention_chunk_size: int | None = None,
) -> Tensor:
    """Causal attention of each sequence's new queries over its cached context. Returns q's shape
    (written into `out`, a tensor of q's shape and dtype, when given).

    max_context_len: at least every context_lens entry; None reads it from context_lens (a device sync).
    k_scale, v_scale: an FP8 cache's dequantization scales (K = k_scale * k_cache).
    index_cache: a dict that lives for one step (the ForwardBatch's): the index tensors the kernels
    derive from query_lens are made in the first layer and reused by the others.
    prefill_index: the step's sequences from device tensors (PrefillIndex; query_lens, max_context_len
    and index_cache are not read), every one through the prefill kernel, into prefill_index.out.
    softcap: the attention logits' soft cap (Gemma 2's attn_logit_softcapping): each scaled score s becomes
    softcap * tanh(s / softcap) before the causal / window mask and the softmax; None: no cap.
    key_limits: [num_tokens] int32 on q's device, the last key position each query may attend to in place of its
    own (Gemma 3's image tokens see their whole image: the image's last position); every entry at least the query's
    position and within its context; the sliding window still counts back from the query's own position. A
    sequence of one query is taken to have its own position as its limit (the decode path reads none). None:
    causal. Not with prefill_index.
    sinks: [num_heads] float32, gpt-oss's attention sinks: each head's logit joins every query row's softmax as one
    more column (after the scale, the cap and the mask), and its probability is dropped, so a row's weights sum to
    less than 1; None: none.
    attention_chunk_size: Llama 4's chunked local attention: a query at position p sees keys from its chunk's start,
    floor(p / attention_chunk_size) * attention_chunk_size, on (transformers' create_chunked_causal_mask); not with a
    sliding_window. None: no chunks.
    """
    if key_limits is not None and prefill_index is not None:
        raise ValueError("key_limits are not read by a prefill_index's step (a CUDA graph's); run the step eagerly")
    if sliding_window is not None and attention_chunk_size is not None:
        raise ValueError("a layer attends within a sliding_window or in chunks (attention_chunk_size), not both")
    if can_use_triton(q, k_cache):
        from . import attention_triton

        return attention_triton.paged_attention(
            q, k_cache, v_cache, block_tables, context_lens, query_lens, scale, sliding_window, max_context_len,
            k_scale=k_scale, v_scale=v_scale, index_cache=index_cache, out=out, prefill_index=prefill_index,
            softcap=softcap, key_limits=key_limits, sinks=sinks, attention_chunk_size=attention_chunk_size,
        )

    if prefill_index is not None:  # the torch path reads the index's sequences (they start at row 0, in order)
        query_lens = prefill_index.query_lens.tolist()[: prefill_index.pad_seq]  # unused ones: 0 queries
        context_lens, out = context_lens[: len(query_lens)], prefill_index.out[: q.shape[0]]
    out = torch.empty_like(q) if out is None else out
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    start = 0
    for seq, (context_len, query_len) in enumerate(zip(context_lens.tolist(), query_lens)):
        if query_len == 0:  # nothing to compute (a PrefillIndex's unused sequences)
            continue
        num_blocks = -(-context_len // block_size)
        blocks = block_tables[seq, :num_blocks].long()
        k = k_cache[blocks].flatten(0, 1)[:context_len]  # [context_len, num_kv_heads, head_dim]
        v = v_cache[blocks].flatten(0, 1)[:context_len]
        if is_fp8(k_cache):  # the sequence's keys and values, dequantized to float32
            k, v = dequantize_kv(k, k_scale), dequantize_kv(v, v_scale)
        q_seq = q[start : start + query_len].view(query_len, num_kv_heads, group, head_dim)
        # Each KV head serves its `group` query heads: [num_kv_heads, group * query_len, head_dim].
        q_seq = q_seq.permute(1, 2, 0, 3).reshape(num_kv_heads, group * query_len, head_dim)
        scores = torch.bmm(q_seq.float(), k.permute(1, 2, 0).float()) * scale  # [num_kv_heads, group*query_len, context_len]
        if softcap is not None:  # after the scale, before the mask (transformers' Gemma 2 eager attention)
            scores = torch.tanh(scores / softcap) * softcap
        if query_len > 1 or sliding_window is not None or attention_chunk_size is not None:
            limits = None if key_limits is None or query_len == 1 else key_limits[start : start + query_len]
            mask = _causal_mask(query_len, context_len, sliding_window, q.device, limits,
                                attention_chunk_size).repeat(group, 1)
            scores.masked_fill_(~mask, float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:  # rows ordered (KV head, group member, query): head kv * group + member's sink for each
            sink = sinks.to(scores.dtype).view(num_kv_heads, group, 1, 1).expand(-1, -1, query_len, 1)
            probs = torch.softmax(torch.cat((scores, sink.reshape(num_kv_heads, group * query_len, 1)), dim=-1),
                                  dim=-1)[..., :-1]
        attn = torch.bmm(probs, v.permute(1, 0, 2).float())  # [num_kv_heads, group * query_len, head_dim]
        attn = attn.view(num_kv_heads, group, query_len, head_dim).permute(2, 0, 1, 3)
        out[start : start + query_len] = attn.reshape(query_len, num_heads, head_dim).to(q.dtype)
        start += query_len
    return out


def _causal_mask(query_len: int, context_len: int, sliding_window: int | None, device,
                 key_limits: Tensor | None = None, attention_chunk_size: int | None = None) -> Tensor:
    # Query i sits at position context_len - query_len + i and sees keys at positions <= its own (<= its key limit
    # where given), and within the window back from its own, or from its chunk's start on.
    q_pos = torch.arange(context_len - query_len, context_len, device=device).unsqueeze(1)
    k_pos = torch.arange(context_len, device=device).unsqueeze(0)
    mask = k_pos <= (q_pos if key_limits is None else key_limits.long().unsqueeze(1))
    if sliding_window is not None:
        mask &= q_pos - k_pos < sliding_window
    if attention_chunk_size is not None:
        mask &= k_pos >= q_pos // attention_chunk_size * attention_chunk_size
    return mask  # [query_len, context_len]
