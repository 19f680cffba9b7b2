"""Triton kernel of DeepSeek's latent attention in its absorbed form over the paged latent cache (mla_attention.py).

One program per (query row, block of BLOCK_H heads): the heads of a row share every key (the cache holds one latent
per token, not one per head), so a key tile is loaded once for BLOCK_H heads and both dots run on tensor cores with
BLOCK_H rows. A token's cached vector is split as kv_lora_rank + qk_rope_head_dim (512 + 64 for DeepSeek-V2 / V3)
into the latent c_kv and the rope key k_pe, each in its own power-of-two block (narrower dims masked):
  score = (q_latent · c_kv + q_pe · k_pe) * scale,   out_latent = softmax(score) · c_kv
over the keys [0, row_limit) of the row's sequence, through its block table; a row whose limit is 0 (a padding row)
writes zeros. Where the (row, head block) programs are too few to fill the GPU (a decode of few sequences: V2-Lite's
16 heads are one block), each row's keys are split over partitions (a third grid axis), each partition's normalized
output, running max and sum stored in float32 and merged by torch ops after (as the paged-attention decode kernel's
split; a CUDA graph captures both, the split fixed by the graph's max_context_len). An FP8 cache's one scale multiplies every loaded key (the latent and the rope key alike).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import device_num_sms
from .mla_attention import HEADS_PER_PROGRAM, num_partitions

BLOCK_N = 32  # keys per tile
BLOCK_H = HEADS_PER_PROGRAM  # heads per program (tl.dot's smallest M); the split: mla_attention.num_partitions
_LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["stride_bt", "num_rows", "partition_size"])  # (per-step: attention_triton's NOTE (specialization))
def _mla_kernel(
    q_lat_ptr, q_pe_ptr, cache_ptr, bt_ptr, row_seq_ptr, row_limit_ptr, out_ptr, ml_ptr,
    stride_qlt, stride_qlh, stride_qpt, stride_qph, stride_slot, stride_bt, stride_ot, stride_oh,
    num_heads, num_rows, partition_size, scale_log2, kv_scale,
    RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,
):
    row = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    part = tl.program_id(2)
    h_mask = heads < num_heads
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    r_mask, p_mask = offs_r < RANK, offs_p < ROPE
    seq = tl.load(row_seq_ptr + row)
    limit = tl.load(row_limit_ptr + row)
    first = part * partition_size  # this program's keys: [first, min(first + partition_size, limit))
    end = tl.minimum(limit, first + partition_size)
    q_lat = tl.load(q_lat_ptr + row * stride_qlt + heads[:, None] * stride_qlh + offs_r[None, :],
                    mask=h_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_R]
    q_pe = tl.load(q_pe_ptr + row * stride_qpt + heads[:, None] * stride_qph + offs_p[None, :],
                   mask=h_mask[:, None] & p_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_P]
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for start in range(first, end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        blocks = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
        slots = (blocks.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE) * stride_slot  # [BLOCK_N]
        c_kv = tl.load(cache_ptr + slots[:, None] + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :],
                       other=0.0)
        k_pe = tl.load(cache_ptr + slots[:, None] + RANK + offs_p[None, :], mask=n_mask[:, None] & p_mask[None, :],
                       other=0.0)
        c_kv = (c_kv.to(tl.float32) * kv_scale).to(q_lat.dtype)  # [BLOCK_N, BLOCK_R]
        k_pe = (k_pe.to(tl.float32) * kv_scale).to(q_pe.dtype)
        s = tl.dot(q_lat, tl.trans(c_kv), input_precision=PRECISION)
        s += tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION)
        s = tl.where(n_mask[None, :], s * scale_log2, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c_kv.dtype), c_kv, input_precision=PRECISION)
        m_i = m_new
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_ptr += part * num_rows * stride_ot  # (partition p's rows follow partition p - 1's)
    tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_r[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=h_mask[:, None] & r_mask[None, :])
    if SPLIT:  # the partition's running max (exp2 units) and sum, [partitions, rows, heads, 2], for the merge
        ml = ml_ptr + ((part * num_rows + row) * num_heads + heads) * 2
        tl.store(ml, m_i, mask=h_mask)
        tl.store(ml + 1, l_i, mask=h_mask)


def mla_absorbed_attention(q_lat: Tensor, q_pe: Tensor, cache: Tensor, block_tables: Tensor, row_seq: Tensor,
                           row_limit: Tensor, scale: float, kv_scale: float = 1.0, max_context_len: int | None = None,
                           partitions: int | None = None) -> Tensor:
    """q_lat [T, H, kv_lora_rank], q_pe [T, H, qk_rope_head_dim] (q's dtype), cache [num_blocks, block_size,
    kv_lora_rank + qk_rope_head_dim] → out_latent [T, H, kv_lora_rank] in q's dtype; row t attends keys
    [0, row_limit[t]) of sequence row_seq[t] (int32 device tensors). max_context_len: a bound on every row_limit
    (a host value: it sizes the split); partitions: the split forced (None: num_partitions', 1 off CUDA)."""
    num_rows, num_heads, rank = q_lat.shape
    rope = q_pe.shape[-1]
    block_size = cache.shape[1]
    if num_rows == 0:
        return torch.empty_like(q_lat)
    assert q_lat.stride(-1) == 1 and q_pe.stride(-1) == 1 and cache.is_contiguous()
    head_blocks = triton.cdiv(num_heads, BLOCK_H)
    if partitions is None:
        partitions = 1 if max_context_len is None or not q_lat.is_cuda else num_partitions(
            num_rows * head_blocks, max_context_len, device_num_sms(q_lat.device))
    split = partitions > 1
    partition_size = triton.cdiv(triton.cdiv(max_context_len or 1, partitions), BLOCK_N) * BLOCK_N if split else 2**30
    # split: each partition's normalized output in float32, then merged by its share of the softmax's sum
    out = torch.empty((partitions * num_rows, num_heads, rank), dtype=torch.float32 if split else q_lat.dtype,
                      device=q_lat.device)
    ml = torch.empty((partitions, num_rows, num_heads, 2), dtype=torch.float32, device=q_lat.device) if split else out
    _mla_kernel[(num_rows, head_blocks, partitions)](
        q_lat, q_pe, cache, block_tables, row_seq, row_limit, out, ml,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1), num_heads, num_rows, partition_size, scale * _LOG2E, kv_scale,
        RANK=rank, ROPE=rope, BLOCK_R=max(16, triton.next_power_of_2(rank)),
        BLOCK_P=max(16, triton.next_power_of_2(rope)), BLOCK_SIZE=block_size, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N,
        PRECISION="ieee" if q_lat.dtype == torch.float32 else "tf32", SPLIT=split,
    )
    if not split:
        return out
    m, l = ml.unbind(-1)  # [partitions, rows, heads] each
    weight = l * torch.exp2(m - m.amax(dim=0, keepdim=True))  # an empty partition: l 0
    total = weight.sum(dim=0)
    # in place: one copy of the partials (mla_attention.absorbed_split_bytes, what the memory plan holds for it)
    merged = out.view(partitions, num_rows, num_heads, rank).mul_(weight[..., None]).sum(dim=0)
    return merged.div_(torch.where(total > 0, total, 1.0)[..., None]).to(q_lat.dtype)
