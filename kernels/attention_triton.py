"""Triton kernels of paged attention and of the KV-cache write (imported only when a kernel runs).

Shapes and conventions as in kernels/attention.py. Keys are gathered token by token through the
block table (slot = block_table[t // block_size] * block_size + t % block_size), so a key tile is
BLOCK_N tokens whatever the cache's block size. Every K/V load is masked to t < context_len (and to
the causal and sliding-window limits): a slot nothing has written is never read into the result.

NOTE: both kernels are flash-attention style: one pass over the keys with an online softmax
(running max m, running sum l, rescaled accumulator), exp2 with the scale folded into log2(e).
GQA: a program owns one KV head and all `group` query heads that read it, stacked as the rows of
one query tile, so each K/V tile is loaded once per KV head.
  decode  (query_len 1): grid (decode seqs, kv heads, partitions); rows = the group's heads. While
          few sequences decode, the keys are split into partitions (attention.decode_split: 64 to
          512 keys each, together covering max_context_len), so few sequences still fill the GPU.
          Each partition that holds keys of its sequence stores its partial (acc, m, l); one past
          the context (or before a sliding window) is empty and returns at once: the merges read
          only a sequence's non-empty partitions, a contiguous range. From
          attention.MERGE_IN_KERNEL_MIN_PAIRS (sequence, KV head) pairs on, each non-empty
          partition counts itself on its pair's semaphore and the last to arrive merges them, in
          partition order, and resets it (as the split GEMMs sum their splits,
          kernels/split_k_triton.py): no second kernel. Below that (and in a CUDA graph capture
          that finds no semaphores) a second kernel merges them. An
          empty partition would add exact zeros to the merge, so whatever max_context_len is (eager
          steps: the batch's longest context; CUDA graphs: max_model_len), for the same partition
          size the in-kernel merge gives the same bits (the second kernel's sum may associate
          differently on a GPU). In a decode-only step (attention.rotate_write_and_attend) the
          kernel also does rotate_and_write_kv's work: each program rotates its q heads, the
          program whose partition holds the new key writes it (rotated) and its value to the
          token's slot before reading its keys; no separate rotary kernel (benchmarks/RESULTS.md,
          session 20).
  prefill (query_len > 1, chunked prefill too): grid (query blocks, kv heads); rows = (query,
          head) pairs; keys up to the block's last query position, causal mask per row. With key
          limits (HAS_LIMITS: Gemma 3's image tokens attend to their whole image) each row's keys run
          up to its limit instead of its position, and the block's keys up to its rows' largest limit;
          the sliding window still counts back from the position.
Chunked local attention (CHUNKED, a constexpr, with HAS_WINDOW: Llama 4's rope layers; `window` is then the chunk
size C): a query at position p sees keys from its chunk's start, floor(p / C) * C, where a sliding window's first key
is p - window + 1 (_first_key); everything else (the decode's first partitions left empty, the merges' range, the
prefill block's first key tile and per-row mask) is the sliding window's. CHUNKED false compiles none of it.
Soft-capping (SOFTCAP > 0, a constexpr: Gemma 2's attn_logit_softcapping): each score s = q.k * scale
becomes SOFTCAP * tanh(s / SOFTCAP), then the mask and the softmax, as transformers' eager attention.
The kernels then take scale / SOFTCAP (times k_scale) for scale_log2, the tanh's argument, and multiply
the tanh by SOFTCAP * log2(e): the capped score in exp2's units. SOFTCAP 0 compiles none of it (every
other model's kernels are the ones they were). The partition merges read m and l only: unchanged.
Attention sinks (HAS_SINKS, a constexpr: gpt-oss; sink_ptr [num_heads] float32 logits): each head's sink is one
more column of every row's softmax whose value is dropped, so it adds exp(sink) to the denominator only. An unsplit
decode and the prefill kernel start their online softmax from it (m = sink in exp2's units, l = 1, acc = 0); a split
decode's partitions leave it out and both merges start from it instead, so it counts once. HAS_SINKS false compiles
none of it.
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import device_num_sms, to_device
from . import attention
from .attention import PREFILL_BLOCK_ROWS, PrefillIndex, decode_split, is_fp8, prefill_blocks, prefill_queries_per_block
from .pdl_triton import pdl_args, wait_for_inputs
from .split_k_triton import tile_counters

BLOCK_N = 64  # keys per tile
# The decode kernel's keys per tile, by whether the cache is FP8, and its launch. Measured on an H100
# (benchmarks/decode_attention_sweep.py, RESULTS.md session 9): with a bf16 cache 64 keys, 4 warps,
# 3 stages was already the fastest of 12 tiles/launches at every shape (2.7 TB/s at 512 x ~192
# keys); an FP8 cache, whose tiles are converted before the dots, runs 6-23% faster with 32.
DECODE_BLOCK_N = {False: 64, True: 32}
DECODE_LAUNCH = {"num_warps": 4, "num_stages": 3}
_LOG2E = 1.4426950408889634
# Finite: a fully masked tile leaves m finite, so exp2(m - m_new) is never NaN.
_M_INIT = tl.constexpr(-1.0e30)


@triton.jit
def _softcapped(x, SOFTCAP: tl.constexpr):
    """SOFTCAP * tanh(x) * log2(e): x = s / SOFTCAP, the natural-log score's tanh argument, to the capped score
    in exp2's units. tanh(|x|) = (1 - e) / (1 + e), e = exp(-2|x|) in (0, 1]: no overflow at any x."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # 2 log2(e) |x|
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t) * (SOFTCAP * 1.4426950408889634)


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, offs_t, visible, key_valid, bt_row_ptr, k_ptr, v_ptr, kv_offset, offs_d, d_mask,
    stride_slot, scale_log2, BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """One online-softmax step over the keys offs_t: loads K/V through the block table. With SOFTCAP,
    scale_log2 is scale / SOFTCAP (the module docstring)."""
    block_ids = tl.load(bt_row_ptr + offs_t // BLOCK_SIZE, mask=key_valid, other=0)
    slots = block_ids.to(tl.int64) * BLOCK_SIZE + offs_t % BLOCK_SIZE  # [BLOCK_N]
    kv_mask = key_valid[:, None] & d_mask[None, :]
    kv_offsets = slots[:, None] * stride_slot + kv_offset + offs_d[None, :]
    # An FP8 cache is widened to q's dtype in registers (exact); its scales are folded into
    # scale_log2 (K) and the output (V) by the callers.
    k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, BLOCK_D]
    v = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [rows, BLOCK_N]
    if SOFTCAP > 0:  # capped before the mask
        s = _softcapped(s, SOFTCAP)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _first_key(position, window, CHUNKED: tl.constexpr):
    """The first key a query at `position` sees under HAS_WINDOW: a sliding window's position - window + 1 (below 0
    early on), or with CHUNKED its chunk's start, floor(position / window) * window (window: the chunk size)."""
    if CHUNKED:
        first = position // window * window
    else:
        first = position - window + 1
    return first


# NOTE (specialization): Triton compiles a variant per value class (== 1, divisible by 16, other) of
# each integer argument. The block-table width of an eager step is its longest sequence's block
# count, so stride_bt changes from step to step; left specialized, a variant compiled in the middle of
# serving (0.4-1 s with the GPU idle, measured in a 128/128 run, benchmarks/RESULTS.md issue 12).
# Such per-step integers are marked do_not_specialize; the kernels never need their alignment.
@triton.jit(do_not_specialize=["window", "num_partitions", "partition_size", "stride_bt"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, seq_ptr, row_ptr, out_ptr, part_acc_ptr, part_ml_ptr, counter_ptr,
    scale_log2, v_scale, window, num_heads, num_partitions, partition_size,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_slot, stride_kvh,
    new_k_ptr, new_v_ptr, pos_ptr, cos_sin_ptr, slot_ptr, inv_k_scale, inv_v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    IS_PARTITIONED: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr, IS_DENSE: tl.constexpr,
    MERGE_IN_KERNEL: tl.constexpr, ROTATE: tl.constexpr, FP8_MAX: tl.constexpr, PDL: tl.constexpr,
    SOFTCAP: tl.constexpr = 0.0, sink_ptr=None, HAS_SINKS: tl.constexpr = False, CHUNKED: tl.constexpr = False,
):
    """ROTATE (a decode-only step): q and this step's keys arrive unrotated and this step's keys and
    values are not in the cache yet. Every program rotates its q heads (as _rotary_write_kv_kernel
    does, the same rounding); the program whose partition holds the new key (position
    context_len - 1) rotates it and stores it with its value at the token's slot, then reads them back
    with the other keys: one kernel a layer instead of two, and the same bits."""
    wait_for_inputs(PDL)
    i, kv_head, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq, row, context_len = _decode_row(i, seq_ptr, row_ptr, ctx_ptr, IS_DENSE)
    lo = part * partition_size  # num_partitions * partition_size covers every context of the launch
    hi = tl.minimum(lo + partition_size, context_len)
    if HAS_WINDOW:  # the one query sits at context_len - 1 (a window: it sees keys t > context_len - 1 - window)
        lo = tl.maximum(lo, _first_key(context_len - 1, window, CHUNKED))
    if not IS_PARTITIONED or lo < hi:  # else an empty partition: no partial, no count (the merges skip it)
        offs_g, offs_d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
        g_mask, d_mask = offs_g < GROUP, offs_d < HEAD_DIM
        heads = kv_head * GROUP + offs_g
        q_mask = g_mask[:, None] & d_mask[None, :]
        q_ptrs = q_ptr + row * stride_qt + heads[:, None] * stride_qh
        if ROTATE:
            cs_ptrs = cos_sin_ptr + tl.load(pos_ptr + row) * stride_cs + offs_d % (HEAD_DIM // 2)
            cos = tl.load(cs_ptrs, mask=d_mask, other=0.0).to(tl.float32)
            sin = tl.load(cs_ptrs + HEAD_DIM // 2, mask=d_mask, other=0.0).to(tl.float32)
            q = _rotated(q_ptrs, offs_d[None, :], q_mask, cos[None, :], sin[None, :], HEAD_DIM // 2)
            if context_len - 1 < hi:  # this partition holds the new key (lo <= context_len - 1 always)
                cache = tl.load(slot_ptr + row).to(tl.int64) * stride_slot + kv_head * stride_kvh + offs_d
                k = _rotated(new_k_ptr + row * stride_kt + kv_head * stride_kh, offs_d, d_mask, cos, sin,
                             HEAD_DIM // 2)
                _store_kv(k_ptr + cache, k, d_mask, inv_k_scale, FP8_MAX)
                v = tl.load(new_v_ptr + row * stride_vt + kv_head * stride_vh + offs_d, mask=d_mask)
                _store_kv(v_ptr + cache, v, d_mask, inv_v_scale, FP8_MAX)
                tl.debug_barrier()  # the stores are seen by every thread's key loads below
        else:
            q = tl.load(q_ptrs + offs_d[None, :], mask=q_mask, other=0.0)
        _decode_partition(
            q, k_ptr, v_ptr, bt_ptr, out_ptr, part_acc_ptr, part_ml_ptr, counter_ptr, scale_log2, v_scale, window,
            num_heads, num_partitions, partition_size, stride_ot, stride_oh, stride_bt,
            stride_slot, stride_kvh, i, kv_head, part, seq, row, context_len, lo, hi, offs_d, g_mask, d_mask,
            heads, q_mask, HEAD_DIM, BLOCK_G, BLOCK_D, BLOCK_N, BLOCK_SIZE, IS_PARTITIONED, HAS_WINDOW,
            PRECISION, MERGE_IN_KERNEL, SOFTCAP, sink_ptr, HAS_SINKS, CHUNKED,
        )


@triton.jit
def _rotated(ptrs, offs_d, mask, cos, sin, HALF: tl.constexpr):
    """Heads at ptrs (+ offs_d, head_dim innermost) under the rotary embedding (rotate-half), rounded
    to their dtype: as _rotated_halves, element d paired with d + HALF or d - HALF."""
    first = offs_d < HALF
    x = tl.load(ptrs + offs_d, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(ptrs + tl.where(first, offs_d + HALF, offs_d - HALF), mask=mask, other=0.0).to(tl.float32)
    return tl.where(first, x * cos - y * sin, x * cos + y * sin).to(ptrs.dtype.element_ty)


@triton.jit
def _decode_row(i, seq_ptr, row_ptr, ctx_ptr, IS_DENSE: tl.constexpr):
    """Decode sequence i's (sequence index, query row, context length)."""
    if IS_DENSE:  # every sequence decodes: sequence i is query row i (no index tensors to build)
        seq, row = i, i.to(tl.int64)
    else:
        seq, row = tl.load(seq_ptr + i), tl.load(row_ptr + i).to(tl.int64)
    return seq, row, tl.load(ctx_ptr + seq)


@triton.jit
def _busy_partitions(context_len, window, partition_size, HAS_WINDOW: tl.constexpr, CHUNKED: tl.constexpr):
    """The partitions [first, end) that hold keys of a context (a sliding window's or chunk's first keys may
    leave the first ones empty)."""
    end = tl.cdiv(context_len, partition_size)
    if HAS_WINDOW:
        first = tl.maximum(_first_key(context_len - 1, window, CHUNKED), 0) // partition_size
    else:
        first = end * 0
    return first, end


@triton.jit
def _decode_partition(
    q, k_ptr, v_ptr, bt_ptr, out_ptr, part_acc_ptr, part_ml_ptr, counter_ptr, scale_log2, v_scale, window,
    num_heads, num_partitions, partition_size, stride_ot, stride_oh, stride_bt, stride_slot,
    stride_kvh, i, kv_head, part, seq, row, context_len, lo, hi, offs_d, g_mask, d_mask, heads, q_mask,
    HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, IS_PARTITIONED: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    MERGE_IN_KERNEL: tl.constexpr, SOFTCAP: tl.constexpr, sink_ptr, HAS_SINKS: tl.constexpr, CHUNKED: tl.constexpr,
):
    """One (sequence, KV head, partition)'s keys lo ... hi - 1 against q [BLOCK_G, BLOCK_D] (the group's
    heads): its output, or its partial (merged here by the last partition, MERGE_IN_KERNEL). An unsplit decode
    starts from the heads' sinks; a partition's partial leaves them to the merge."""
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    m_i, l_i = _softmax_start(sink_ptr, heads, g_mask, BLOCK_G, HAS_SINKS and not IS_PARTITIONED)
    bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        offs_t = start + tl.arange(0, BLOCK_N)
        key_valid = offs_t < hi
        visible = g_mask[:, None] & key_valid[None, :]
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, offs_t, visible, key_valid, bt_row_ptr, k_ptr, v_ptr, kv_head * stride_kvh,
            offs_d, d_mask, stride_slot, scale_log2, BLOCK_SIZE, PRECISION, SOFTCAP,
        )
    acc = acc * v_scale  # the FP8 V scale (1.0 otherwise); linear, so partitions merge alike
    if IS_PARTITIONED:
        base = (i * num_heads + heads) * num_partitions + part  # [BLOCK_G]
        tl.store(part_acc_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=q_mask)
        tl.store(part_ml_ptr + base * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + base * 2 + 1, l_i, mask=g_mask)
        if MERGE_IN_KERNEL:  # the last non-empty partition of (sequence, KV head) to finish merges them
            counter = counter_ptr + i * tl.num_programs(1) + kv_head
            first, end = _busy_partitions(context_len, window, partition_size, HAS_WINDOW, CHUNKED)
            tl.debug_barrier()  # every thread's partial is stored before the count is released
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == end - first - 1:
                _merge_partitions(part_acc_ptr, part_ml_ptr, out_ptr, i, row, heads, offs_d, g_mask, q_mask,
                                  num_heads, num_partitions, first, end, stride_ot, stride_oh, HEAD_DIM, BLOCK_G,
                                  BLOCK_D, sink_ptr, HAS_SINKS)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    else:
        _store_out(out_ptr, acc, l_i, row, heads, offs_d, q_mask, stride_ot, stride_oh)


@triton.jit
def _softmax_start(sink_ptr, heads, mask, BLOCK: tl.constexpr, HAS_SINKS: tl.constexpr):
    """The online softmax's (m, l) before any key, [BLOCK] each: (_M_INIT, 0), or with the heads' sinks (sink in
    exp2's units, 1): the sink's column, whose value is 0 (acc starts at 0 either way)."""
    if HAS_SINKS:
        m_i = tl.load(sink_ptr + heads, mask=mask, other=0.0).to(tl.float32) * 1.4426950408889634
        l_i = tl.full((BLOCK,), 1.0, tl.float32)
    else:
        m_i = tl.full((BLOCK,), _M_INIT, tl.float32)
        l_i = tl.zeros((BLOCK,), dtype=tl.float32)
    return m_i, l_i


@triton.jit
def _store_out(out_ptr, acc, l_i, row, heads, offs_d, q_mask, stride_ot, stride_oh):
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l > 0 on every real head row
    out_ptrs = out_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _merge_partitions(part_acc_ptr, part_ml_ptr, out_ptr, i, row, heads, offs_d, g_mask, q_mask, num_heads,
                      num_partitions, first, end, stride_ot, stride_oh, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                      BLOCK_D: tl.constexpr, sink_ptr, HAS_SINKS: tl.constexpr):
    """out[row, heads] = sum_p exp2(m_p - M) acc_p / sum_p exp2(m_p - M) l_p over the non-empty
    partitions [first, end) of decode sequence i (M: their largest m), in one pass in partition
    order (online, as over keys). An empty partition (m = _M_INIT, l = 0, acc = 0) would add exact
    zeros wherever it sat (before a real one the sums stay 0, after one its weight is exactly 0 and
    the rescale exactly 1), so leaving them out changes no bit, and one real partition gives acc / l
    exactly, as an unsplit decode does. With sinks the merge starts from them (_softmax_start)."""
    rows = (i * num_heads + heads) * num_partitions  # [BLOCK_G]
    m_i, l_i = _softmax_start(sink_ptr, heads, g_mask, BLOCK_G, HAS_SINKS)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for part in range(first, end):
        base = rows + part
        m_p = tl.load(part_ml_ptr + base * 2, mask=g_mask, other=_M_INIT, cache_modifier=".cg")
        l_p = tl.load(part_ml_ptr + base * 2 + 1, mask=g_mask, other=0.0, cache_modifier=".cg")
        acc_p = tl.load(part_acc_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], mask=q_mask, other=0.0,
                        cache_modifier=".cg")
        m_new = tl.maximum(m_i, m_p)
        rescale, weight = tl.exp2(m_i - m_new), tl.exp2(m_p - m_new)
        l_i = l_i * rescale + weight * l_p
        acc = acc * rescale[:, None] + weight[:, None] * acc_p
        m_i = m_new
    _store_out(out_ptr, acc, l_i, row, heads, offs_d, q_mask, stride_ot, stride_oh)


@triton.jit(do_not_specialize=["window", "num_partitions", "partition_size"])
def _merge_partitions_kernel(
    part_acc_ptr, part_ml_ptr, ctx_ptr, seq_ptr, row_ptr, out_ptr, window, num_heads, num_partitions, partition_size,
    stride_ot, stride_oh, HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_DENSE: tl.constexpr, HAS_WINDOW: tl.constexpr, PDL: tl.constexpr, sink_ptr=None, HAS_SINKS: tl.constexpr = False,
    CHUNKED: tl.constexpr = False,
):
    """The merge as a kernel of its own, one program per (decode seq, head), every non-empty
    partition loaded at once: out = sum_p exp2(m_p - M) acc_p / sum_p exp2(m_p - M) l_p. Below
    attention.MERGE_IN_KERNEL_MIN_PAIRS pairs (one since session 20: in practice where a CUDA graph
    capture finds no semaphores)."""
    wait_for_inputs(PDL)
    i, head = tl.program_id(0), tl.program_id(1)
    _, row, context_len = _decode_row(i, seq_ptr, row_ptr, ctx_ptr, IS_DENSE)
    first, end = _busy_partitions(context_len, window, partition_size, HAS_WINDOW, CHUNKED)
    offs_p, offs_d = tl.arange(0, BLOCK_P), tl.arange(0, BLOCK_D)
    p_mask, d_mask = (offs_p >= first) & (offs_p < end), offs_d < HEAD_DIM
    base = (i * num_heads + head) * num_partitions + offs_p  # [BLOCK_P]
    m = tl.load(part_ml_ptr + base * 2, mask=p_mask, other=_M_INIT)
    l = tl.load(part_ml_ptr + base * 2 + 1, mask=p_mask, other=0.0)
    top = tl.max(m, axis=0)
    if HAS_SINKS:  # the sink's column: exp2(sink - M) in the denominator, M over it too
        sink = tl.load(sink_ptr + head).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(top, sink)
    weights = tl.exp2(m - top)
    acc = tl.load(part_acc_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], mask=p_mask[:, None] & d_mask[None, :], other=0.0)
    denominator = tl.sum(weights * l, axis=0)
    if HAS_SINKS:
        denominator += tl.exp2(sink - top)
    out = tl.sum(weights[:, None] * acc, axis=0) / denominator
    tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit(do_not_specialize=["window", "stride_bt"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, qlen_ptr, qoff_ptr, blk_seq_ptr, blk_q_ptr, out_ptr,
    scale_log2, v_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_slot, stride_kvh,
    GROUP: tl.constexpr, QUERIES_PER_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr, SOFTCAP: tl.constexpr = 0.0, limit_ptr=None, HAS_LIMITS: tl.constexpr = False,
    sink_ptr=None, HAS_SINKS: tl.constexpr = False, CHUNKED: tl.constexpr = False,
):
    blk, kv_head = tl.program_id(0), tl.program_id(1)
    seq = tl.load(blk_seq_ptr + blk)
    q_begin = tl.load(blk_q_ptr + blk)  # first query of this block, counted within its sequence
    context_len, query_len = tl.load(ctx_ptr + seq), tl.load(qlen_ptr + seq)
    first_row = tl.load(qoff_ptr + seq).to(tl.int64)
    offs_r, offs_d = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_D)
    query = q_begin + offs_r // GROUP  # [BLOCK_R] query index within the sequence
    heads = kv_head * GROUP + offs_r % GROUP
    row_valid = (offs_r < QUERIES_PER_BLOCK * GROUP) & (query < query_len)
    d_mask = offs_d < HEAD_DIM
    position = context_len - query_len + query  # [BLOCK_R] of each row's query
    rows = first_row + query
    q_mask = row_valid[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    m_i, l_i = _softmax_start(sink_ptr, heads, row_valid, BLOCK_R, HAS_SINKS)
    last_query = tl.minimum(q_begin + QUERIES_PER_BLOCK, query_len) - 1
    hi = context_len - query_len + last_query + 1  # keys after the block's last query are never seen
    limit = position  # the last key each row sees
    if HAS_LIMITS:  # (an image's tokens: its last position; every limit is within the context)
        limit = tl.load(limit_ptr + rows, mask=row_valid, other=0)
        hi = tl.maximum(hi, tl.max(tl.where(row_valid, limit, 0), axis=0) + 1)
    lo = 0
    if HAS_WINDOW:  # the block's first query sees the earliest keys
        lo = tl.maximum(0, _first_key(context_len - query_len + q_begin, window, CHUNKED))
    bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        offs_t = start + tl.arange(0, BLOCK_N)
        key_valid = offs_t < hi
        visible = row_valid[:, None] & key_valid[None, :] & (offs_t[None, :] <= limit[:, None])
        if HAS_WINDOW:
            visible = visible & (offs_t[None, :] >= _first_key(position, window, CHUNKED)[:, None])
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, offs_t, visible, key_valid, bt_row_ptr, k_ptr, v_ptr, kv_head * stride_kvh,
            offs_d, d_mask, stride_slot, scale_log2, BLOCK_SIZE, PRECISION, SOFTCAP,
        )
    out = acc * v_scale / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _rotated_halves(ptrs, mask, cos, sin, HALF: tl.constexpr):
    """The two rotated halves of the heads at `ptrs` (rotate-half convention), rounded to their dtype."""
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = ptrs.dtype.element_ty
    return (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype)


@triton.jit
def _store_kv(ptrs, x, mask, inv_scale, FP8_MAX: tl.constexpr):
    if FP8_MAX > 0:  # quantize: x / scale, saturated, rounded to nearest even
        x = tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -FP8_MAX), FP8_MAX)
    tl.store(ptrs, x.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, q_out_ptr, num_heads, num_kv_heads,
    inv_k_scale, inv_v_scale, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_slot, stride_ch, stride_qot, stride_qoh,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, FP8_MAX: tl.constexpr, PDL: tl.constexpr,
):
    """Program (token, 0) rotates the token's query heads into q_out (q itself: in place); program
    (token, 1) rotates its key heads and stores them, with its value heads, at the token's slot. k
    itself is not written."""
    wait_for_inputs(PDL)
    token, is_kv = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs_h, offs_d = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_HALF)
    position = tl.load(pos_ptr + token)
    cos = tl.load(cos_sin_ptr + position * stride_cs + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_ptr + position * stride_cs + HALF + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)[None, :]
    if is_kv == 0:
        mask = (offs_h < num_heads)[:, None] & (offs_d < HALF)[None, :]
        ptrs = q_ptr + token * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :]
        q1, q2 = _rotated_halves(ptrs, mask, cos, sin, HALF)
        out_ptrs = q_out_ptr + token * stride_qot + offs_h[:, None] * stride_qoh + offs_d[None, :]
        tl.store(out_ptrs, q1, mask=mask)
        tl.store(out_ptrs + HALF, q2, mask=mask)
    else:
        mask = (offs_h < num_kv_heads)[:, None] & (offs_d < HALF)[None, :]
        slot = tl.load(slot_ptr + token).to(tl.int64)
        cache = slot * stride_slot + offs_h[:, None] * stride_ch + offs_d[None, :]
        k1, k2 = _rotated_halves(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :],
                                 mask, cos, sin, HALF)
        _store_kv(k_cache_ptr + cache, k1, mask, inv_k_scale, FP8_MAX)
        _store_kv(k_cache_ptr + cache + HALF, k2, mask, inv_k_scale, FP8_MAX)
        v_ptrs = v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
        _store_kv(v_cache_ptr + cache, tl.load(v_ptrs, mask=mask), mask, inv_v_scale, FP8_MAX)
        _store_kv(v_cache_ptr + cache + HALF, tl.load(v_ptrs + HALF, mask=mask), mask, inv_v_scale, FP8_MAX)


def _check_cache(k_cache: Tensor, v_cache: Tensor) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    if k_cache.stride(3) != 1 or k_cache.stride(0) != block_size * k_cache.stride(1):
        raise ValueError("the KV cache must be contiguous in [num_blocks, block_size] slots, head_dim innermost")


def _check_rotary_inputs(q: Tensor, k: Tensor, v: Tensor, cos_sin_cache: Tensor) -> None:
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("the rotary embedding's kernels need unit stride along head_dim")


def rotate_and_write_kv(q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos_sin_cache: Tensor, k_cache: Tensor,
                        v_cache: Tensor, slot_mapping: Tensor, k_scale: float = 1.0, v_scale: float = 1.0,
                        q_out: Tensor | None = None) -> Tensor:
    """As kernels.attention.rotate_and_write_kv, in one kernel; the rotated q is written to q_out (a
    tensor of q's shape with unit stride along head_dim; default: q itself, in place) and returned.
    q, k, v need unit stride along head_dim (slices of the fused qkv output are fine)."""
    _check_cache(k_cache, v_cache)
    _check_rotary_inputs(q, k, v, cos_sin_cache)
    q_out = q if q_out is None else q_out
    if q_out.shape != q.shape or q_out.dtype != q.dtype or q_out.stride(-1) != 1:
        raise ValueError(f"q_out must be {tuple(q.shape)} {q.dtype} with unit stride along head_dim")
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return q_out
    num_kv_heads, half = k.shape[1], head_dim // 2
    _rotary_write_kv_kernel[(num_tokens, 2)](
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, q_out, num_heads, num_kv_heads,
        1.0 / k_scale, 1.0 / v_scale, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin_cache.stride(0), k_cache.stride(1), k_cache.stride(2), q_out.stride(0), q_out.stride(1),
        HALF=half, BLOCK_H=triton.next_power_of_2(max(num_heads, num_kv_heads)), BLOCK_HALF=triton.next_power_of_2(half),
        FP8_MAX=torch.finfo(k_cache.dtype).max if is_fp8(k_cache) else 0.0, **pdl_args(q.device),
    )
    return q_out


def paged_attention(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, context_lens: Tensor,
    query_lens: list[int], scale: float, sliding_window: int | None = None, max_context_len: int | None = None,
    num_partitions: int | None = None, k_scale: float = 1.0, v_scale: float = 1.0, index_cache: dict | None = None,
    rotary: tuple[Tensor, Tensor, Tensor, Tensor, Tensor] | None = None, out: Tensor | None = None,
    prefill_index: PrefillIndex | None = None, softcap: float | None = None, key_limits: Tensor | None = None,
    sinks: Tensor | None = None, attention_chunk_size: int | None = None,
) -> Tensor:
    """As kernels.attention.paged_attention (key_limits: read by the prefill kernel only). Sequences with one query go to the decode kernel, the
    rest to the prefill kernel; `num_partitions` forces the decode split (tests), else it is chosen.

    rotary (k, v, positions, cos_sin_cache, slot_mapping), for a step whose query_lens are all 1 only:
    q and k are unrotated and this step's keys and values not yet written; the decode kernel does
    what rotate_and_write_kv would (q is not modified).

    With every query_len 1 and max_context_len given, nothing is read from the device and no tensor
    is made from host data: the call can be captured in a CUDA graph. So can a call with
    `prefill_index` (attention.PrefillIndex: every sequence through the prefill kernel, in the grid its
    buffers fix, into prefill_index.out; query_lens and max_context_len are not read).
    """
    _check_cache(k_cache, v_cache)
    if context_lens.dtype != torch.int32 or context_lens.device != q.device:
        raise ValueError(f"context_lens must be int32 on {q.device}, got {context_lens.dtype} on {context_lens.device}")
    if prefill_index is not None:
        out, index = prefill_index.out[: q.shape[0]], prefill_index
        common = _common(q, k_cache, context_lens, scale, k_scale, v_scale, sliding_window, softcap, sinks,
                         attention_chunk_size)
        _launch_prefill(q, k_cache, v_cache, block_tables, out, index.query_lens, index.first_rows, index.block_seqs,
                        index.block_starts, index.queries_per_block, common)
        return out
    out = torch.empty_like(q) if out is None else out  # [num_tokens, num_heads, head_dim]
    decode = [i for i, n in enumerate(query_lens) if n == 1]
    prefill = [i for i, n in enumerate(query_lens) if n > 1]
    common = _common(q, k_cache, context_lens, scale, k_scale, v_scale, sliding_window, softcap, sinks,
                         attention_chunk_size)
    first_rows = [0, *itertools.accumulate(query_lens)][:-1]  # query row of each sequence's first token
    if rotary is not None:
        if prefill:
            raise ValueError("paged_attention rotates and writes the new keys only in a decode-only step")
        _check_rotary_inputs(q, rotary[0], rotary[1], rotary[3])
        common.update(rotary=rotary, inv_k_scale=1.0 / k_scale, inv_v_scale=1.0 / v_scale,
                      fp8_max=torch.finfo(k_cache.dtype).max if is_fp8(k_cache) else 0.0)
    if decode:
        if max_context_len is None:
            max_context_len = int(context_lens.max())  # a device sync; the model runner passes the bound
        block_n = DECODE_BLOCK_N[is_fp8(k_cache)]
        if num_partitions is None:
            num_partitions, partition_size = _choose_split(len(decode) * k_cache.shape[2], max_context_len, q.device)
        else:
            partition_size = triton.cdiv(triton.cdiv(max_context_len, num_partitions), block_n) * block_n
        is_dense = not prefill
        if is_dense:  # sequence i is query row i: the kernels index by program id
            seqs = rows = context_lens  # not read
        else:
            rows = _int32([first_rows[i] for i in decode], q.device, index_cache, "decode_rows")
            seqs = _int32(decode, q.device, index_cache, "decode_seqs")
        _launch_decode(q, k_cache, v_cache, block_tables, out, len(decode), seqs, rows, is_dense,
                       num_partitions, partition_size, block_n, common)
    if prefill:
        qlens = _int32(query_lens, q.device, index_cache, "query_lens")
        first_rows_t = _int32(first_rows, q.device, index_cache, "first_rows")
        per_block = prefill_queries_per_block(common["group"])
        blocks = prefill_blocks([n if n > 1 else 0 for n in query_lens], per_block)  # decode rows: not here
        blk_seq = _int32([seq for seq, _ in blocks], q.device, index_cache, ("block_seqs", per_block))
        blk_q = _int32([start for _, start in blocks], q.device, index_cache, ("block_starts", per_block))
        _launch_prefill(q, k_cache, v_cache, block_tables, out, qlens, first_rows_t, blk_seq, blk_q, per_block, common,
                        key_limits)
    return out


def _common(q, k_cache, context_lens, scale, k_scale, v_scale, sliding_window, softcap=None, sinks=None,
            attention_chunk_size=None) -> dict:
    """The launch arguments both kernels take. With a soft cap, scale_log2 is the tanh's argument's
    multiplier (scale / softcap) and the kernels multiply the tanh by softcap * log2(e). `sinks` [num_heads]
    float32 (gpt-oss), passed as the kernels' sink_ptr / HAS_SINKS where given. A chunk size goes where the
    window does (window, HAS_WINDOW) with CHUNKED."""
    head_dim, num_kv_heads = q.shape[2], k_cache.shape[2]
    if sliding_window is not None and attention_chunk_size is not None:
        raise ValueError("a layer attends within a sliding_window or in chunks (attention_chunk_size), not both")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive (None: no cap), got {softcap}")
    if sinks is not None and (sinks.shape != (q.shape[1],) or sinks.dtype != torch.float32 or sinks.device != q.device
                              or not sinks.is_contiguous()):
        raise ValueError(f"sinks must be contiguous float32 [{q.shape[1]}] on {q.device}, got {tuple(sinks.shape)} "
                         f"{sinks.dtype} on {sinks.device}")
    return dict(
        sinks={} if sinks is None else {"sink_ptr": sinks, "HAS_SINKS": True},
        context_lens=context_lens, v_scale=v_scale, softcap=float(softcap or 0.0),
        scale_log2=scale * k_scale / softcap if softcap else scale * k_scale * _LOG2E,
        window=sliding_window or attention_chunk_size or 0,
        has_window=sliding_window is not None or attention_chunk_size is not None,
        chunked=attention_chunk_size is not None,
        precision="ieee" if q.dtype == torch.float32 else "tf32",
        block_d=max(16, triton.next_power_of_2(head_dim)), group=q.shape[1] // num_kv_heads,
        block_size=k_cache.shape[1],
    )


def _int32(values: list[int], device: torch.device, cache: dict | None, key: object) -> Tensor:
    """An int32 device tensor of host values the step's query_lens determine: made once per step
    (`cache`, the ForwardBatch's) and sent without a stream sync, then reused by every layer."""
    cache = {} if cache is None else cache
    key = (key, device)
    if key not in cache:
        cache[key] = to_device(torch.tensor(values, dtype=torch.int32), device)
    return cache[key]


def _choose_split(num_programs: int, max_context: int, device: torch.device) -> tuple[int, int]:
    return decode_split(num_programs, max_context, device_num_sms(device) if device.type == "cuda" else 1)


def _merge_block_p(num_partitions: int) -> int:
    """The second merge kernel's partitions per load: one width up to MAX_PARTITIONS, so that an
    eager step's bound (its longest context, which sets the partition count) compiles no new
    variant; only the empty partitions' lanes are masked off."""
    return max(attention.MAX_PARTITIONS, triton.next_power_of_2(num_partitions))


def _launch_decode(q, k_cache, v_cache, block_tables, out, num_decode, seqs, rows, is_dense, num_partitions,
                   partition_size, block_n, c) -> None:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    is_partitioned = num_partitions > 1
    part_acc = torch.empty(num_decode, num_heads, num_partitions, head_dim, device=q.device, dtype=torch.float32) if is_partitioned else out
    part_ml = torch.empty(num_decode, num_heads, num_partitions, 2, device=q.device, dtype=torch.float32) if is_partitioned else out
    # one semaphore per (sequence, KV head): the split GEMMs' (kernels of one stream never overlap)
    is_merged_in_kernel = is_partitioned and num_decode * num_kv_heads >= attention.MERGE_IN_KERNEL_MIN_PAIRS
    counters = tile_counters(q.device, num_decode * num_kv_heads) if is_merged_in_kernel else None
    block_g = max(16, triton.next_power_of_2(c["group"]))
    rotary = c.get("rotary")
    new_k, new_v, positions, cos_sin, slots = rotary if rotary is not None else (q, q, q, q, q)
    _decode_kernel[(num_decode, num_kv_heads, num_partitions)](
        q, k_cache, v_cache, block_tables, c["context_lens"], seqs, rows, out, part_acc, part_ml,
        counters if counters is not None else out,
        c["scale_log2"], c["v_scale"], c["window"], num_heads, num_partitions, partition_size,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(1), k_cache.stride(2),
        new_k, new_v, positions, cos_sin, slots, c.get("inv_k_scale", 1.0), c.get("inv_v_scale", 1.0),
        new_k.stride(0), new_k.stride(1), new_v.stride(0), new_v.stride(1), cos_sin.stride(0),
        GROUP=c["group"], HEAD_DIM=head_dim, BLOCK_G=block_g,
        BLOCK_D=c["block_d"], BLOCK_N=block_n, BLOCK_SIZE=c["block_size"],
        IS_PARTITIONED=is_partitioned, HAS_WINDOW=c["has_window"], PRECISION=c["precision"], IS_DENSE=is_dense,
        MERGE_IN_KERNEL=counters is not None, ROTATE=rotary is not None, FP8_MAX=c.get("fp8_max", 0.0),
        SOFTCAP=c["softcap"], CHUNKED=c["chunked"], **c["sinks"], **DECODE_LAUNCH, **pdl_args(q.device),
    )
    if is_partitioned and counters is None:
        _merge_partitions_kernel[(num_decode, num_heads)](
            part_acc, part_ml, c["context_lens"], seqs, rows, out, c["window"], num_heads, num_partitions,
            partition_size, out.stride(0), out.stride(1), HEAD_DIM=head_dim,
            BLOCK_P=_merge_block_p(num_partitions), BLOCK_D=c["block_d"], IS_DENSE=is_dense,
            HAS_WINDOW=c["has_window"], CHUNKED=c["chunked"], **c["sinks"], **pdl_args(q.device),
        )


def _launch_prefill(q, k_cache, v_cache, block_tables, out, qlens, first_rows, blk_seq, blk_q, queries_per_block,
                    c, key_limits: Tensor | None = None) -> None:
    """One program per (block of queries, KV head): blk_seq / blk_q name each block's sequence and
    first query (attention.prefill_blocks)."""
    head_dim, num_kv_heads = q.shape[2], k_cache.shape[2]
    block_r = max(PREFILL_BLOCK_ROWS, triton.next_power_of_2(c["group"]))
    _prefill_kernel[(blk_seq.shape[0], num_kv_heads)](
        q, k_cache, v_cache, block_tables, c["context_lens"], qlens, first_rows, blk_seq, blk_q, out,
        c["scale_log2"], c["v_scale"], c["window"],
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(1), k_cache.stride(2),
        GROUP=c["group"], QUERIES_PER_BLOCK=queries_per_block, HEAD_DIM=head_dim, BLOCK_R=block_r,
        BLOCK_D=c["block_d"], BLOCK_N=BLOCK_N, BLOCK_SIZE=c["block_size"], HAS_WINDOW=c["has_window"],
        PRECISION=c["precision"], SOFTCAP=c["softcap"], CHUNKED=c["chunked"], **c["sinks"],
        **({} if key_limits is None else {"limit_ptr": key_limits, "HAS_LIMITS": True}),
    )
