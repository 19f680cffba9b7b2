"""Triton fused MoE (imported only when a kernel runs): a grouped GEMM over expert-sorted slots.

NOTE (algorithm): `align_by_expert` (fused_moe.py) lays the (token, expert) pairs out expert by expert,
each expert's run padded to block_m. One program computes block_m slots × BLOCK_N outputs of one
expert: it gathers the slots' input rows (x's token rows for gate_up, the pairs' own rows for down),
multiplies by that expert's weight [N, K] and scatters the rows to the pairs' output rows, scaled
by the routing weight in the down GEMM. Blocks of padding or of no expert exit at once. Per kind:
  dense / fp8   the weight tile widened to the input dtype in registers (fp8: per-channel scale on
                the float32 accumulator);
  w8a8-fp8      FP8 × FP8 tensor-core dot; row scale × channel scale on the accumulator (the input
                rows are quantized before the launch, once per token or per pair);
  w8a8-fp8-block  FP8 × FP8 dots of one scale group's columns each (BLOCK_K = the group, at most 128,
                whatever the tiles' block_k: each step's scaling costs a pass over the accumulator),
                each product times its rows' and channels' scales of that group added to the float32
                accumulator (the inputs quantized per row and group before the launch);
  w4a16         `w4_tiles` packed 128-column tiles ([16, BLOCK_N] int32 each) per step, unpacked in
                registers to [128·tiles, BLOCK_N] in natural K order (row 16 j + r of a tile is nibble
                j of its word row r), turned
                into (level − zero) · scale in the input dtype (the same rounding as the w4a16
                dequantize + matmul path) and fed to tl.dot.
A bias (HAS_BIAS: gpt-oss's experts) is added to the float32 accumulator after the scales, before the routing
weight; the activation between the GEMMs is fused_moe.gated_activation (SiLU · up, the clamped SwiGLU, or relu²).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .fp8 import quantize_fp8_per_token_group
from .fused_moe import (ExpertWeights, MoeConfig, align_by_expert, gated_activation, quantize_input_fp8,
                        select_moe_config)
from .w4a16_gemm import K_TILE
from .w4a16_triton import _group_params


@triton.jit
def _store_rows(acc, c_ptr, scale_ptr, a_scale_ptr, topk_weights_ptr, pairs, rows, is_pair, expert, offs_n, N,
                stride_cm, HAS_SCALE: tl.constexpr, HAS_A_SCALE: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                bias_ptr, HAS_BIAS: tl.constexpr):
    """Scales on the float32 accumulator (per channel, per input row), the expert's bias [E, N], the routing weight,
    then the rows scattered to their pairs' output rows."""
    n_mask = offs_n < N
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + expert * N + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_A_SCALE:
        acc *= tl.load(a_scale_ptr + rows, mask=is_pair, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if MUL_WEIGHT:
        acc *= tl.load(topk_weights_ptr + pairs, mask=is_pair, other=0.0)[:, None]
    out = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(out, acc.to(c_ptr.dtype.element_ty), mask=is_pair[:, None] & n_mask[None, :])


@triton.jit
def _grouped_gemm_kernel(a_ptr, a_scale_ptr, w_ptr, scale_ptr, c_ptr, pairs_ptr, block_expert_ptr, topk_weights_ptr,
                         num_pairs, num_experts, N, K, stride_am, stride_we, stride_wn, stride_cm,
                         stride_asm, stride_asg, stride_se, stride_sn,
                         A_ROWS_PER_PAIR: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_A_SCALE: tl.constexpr,
                         GROUP: tl.constexpr, MUL_WEIGHT: tl.constexpr, PRECISION: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         bias_ptr=None, HAS_BIAS: tl.constexpr = False):
    """dense, fp8 (weight-only: HAS_SCALE), w8a8-fp8 (HAS_A_SCALE: a is FP8 too) and w8a8-fp8-block (GROUP > 0:
    GROUP input columns per scale, a multiple of BLOCK_K; a_scale [rows, G] and scale [E, N, G] by their strides)
    experts."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= num_experts:
        return
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    is_pair = pairs < num_pairs
    rows = (pairs // A_ROWS_PER_PAIR).to(tl.int64)  # gate_up: the pair's token; down: the pair itself
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=is_pair[:, None] & (ks[None, :] < K), other=0.0)
        w = tl.load(w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + ks[:, None],
                    mask=(offs_n[None, :] < N) & (ks[:, None] < K), other=0.0)  # [BLOCK_K, BLOCK_N]
        if GROUP > 0:  # this step's product times its group's row and channel scales
            g = k0 // GROUP
            a_s = tl.load(a_scale_ptr + rows * stride_asm + g * stride_asg, mask=is_pair, other=0.0)
            w_s = tl.load(scale_ptr + expert * stride_se + offs_n * stride_sn + g, mask=offs_n < N, other=0.0)
            acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        elif HAS_A_SCALE:
            acc = tl.dot(a, w, acc)  # FP8 × FP8, float32 accumulation
        else:
            acc = tl.dot(a, w.to(a.dtype), acc, input_precision=PRECISION)
    _store_rows(acc, c_ptr, scale_ptr, a_scale_ptr, topk_weights_ptr, pairs, rows, is_pair, expert, offs_n, N,
                stride_cm, HAS_SCALE, HAS_A_SCALE, MUL_WEIGHT, bias_ptr, HAS_BIAS)


@triton.jit
def _grouped_w4a16_kernel(a_ptr, qw_ptr, s_ptr, qz_ptr, c_ptr, pairs_ptr, block_expert_ptr, topk_weights_ptr,
                          num_pairs, num_experts, N, K, num_groups, num_tiles, stride_am, stride_qwe, stride_se,
                          stride_qze, stride_cm, A_ROWS_PER_PAIR: tl.constexpr, GROUP_SIZE: tl.constexpr,
                          HAS_ZEROS: tl.constexpr, MUL_WEIGHT: tl.constexpr, PRECISION: tl.constexpr,
                          TILES: tl.constexpr, GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          bias_ptr=None, HAS_BIAS: tl.constexpr = False):
    """w4a16 experts in the gpu layout, TILES packed 128-column tiles per step, GROUPS = the groups
    a step spans (GROUP_SIZE and TILES are powers of two; per channel: GROUP_SIZE >= the padded K)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert >= num_experts:
        return
    pairs = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    is_pair = pairs < num_pairs
    rows = (pairs // A_ROWS_PER_PAIR).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_tt, offs_r, shifts = tl.arange(0, TILES), tl.arange(0, 16), 4 * tl.arange(0, 8)
    offs_k, offs_g = tl.arange(0, TILES * 128), tl.arange(0, GROUPS)
    qw, s, qz = qw_ptr + expert * stride_qwe, s_ptr + expert * stride_se, qz_ptr + expert * stride_qze
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t0 in range(0, num_tiles, TILES):
        tiles = t0 + offs_tt  # [TILES]; past the last tile: words 0, inputs 0
        word_rows = (tiles[:, None] * 16 + offs_r[None, :])[:, :, None]  # [TILES, 16, 1]
        words = tl.load(qw + word_rows * N + offs_n[None, None, :],
                        mask=(tiles < num_tiles)[:, None, None] & n_mask[None, None, :], other=0)
        levels = (words[:, None, :, :] >> shifts[None, :, None, None]) & 0xF  # [TILES, 8, 16, BLOCK_N]
        # Row 128 tt + 16 j + r of the flattened levels is input column 128 (t0 + tt) + 16 j + r (natural
        # K order), viewed as GROUPS groups of the step's columns, each with its scale and zero row.
        magic = tl.reshape(levels | 0x4B000000, (GROUPS, TILES * 128 // GROUPS, BLOCK_N)).to(tl.float32, bitcast=True)
        g = tl.minimum((t0 * 128 + offs_g * (TILES * 128 // GROUPS)) // GROUP_SIZE, num_groups - 1)[:, None]
        scale, zero = _group_params(s, qz, g, offs_n[None, :], n_mask[None, :], N, HAS_ZEROS)  # [GROUPS, BLOCK_N]
        offset = 8388608.0 + zero  # level | 0x4B000000 read as float32 is 2**23 + level
        b = tl.reshape((magic - offset[:, None, :]) * scale[:, None, :], (TILES * 128, BLOCK_N))
        ks = t0 * 128 + offs_k
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :], mask=is_pair[:, None] & (ks[None, :] < K), other=0.0)
        acc = tl.dot(a, b.to(a.dtype), acc, input_precision=PRECISION)
    _store_rows(acc, c_ptr, s_ptr, s_ptr, topk_weights_ptr, pairs, rows, is_pair, expert, offs_n, N,
                stride_cm, False, False, MUL_WEIGHT, bias_ptr, HAS_BIAS)


def _precision(a: Tensor) -> str:
    return "ieee" if a.dtype == torch.float32 else "tf32"  # float32: a checking mode, exact products


def _grouped_gemm(a: Tensor, a_scale: Tensor | None, w: ExpertWeights, out: Tensor, sorted_pairs: Tensor,
                  block_expert: Tensor, topk_weights: Tensor, rows_per_pair: int, mul_weight: bool,
                  config: MoeConfig) -> None:
    n, k = w.out_features, a.shape[1]
    grid = (block_expert.shape[0], triton.cdiv(n, config.block_n))
    common = dict(A_ROWS_PER_PAIR=rows_per_pair, MUL_WEIGHT=mul_weight, PRECISION=_precision(a),
                  BLOCK_M=config.block_m, BLOCK_N=config.block_n, num_warps=config.num_warps,
                  num_stages=config.num_stages)
    if w.bias is not None:  # [E, N], contiguous (the kernels index expert * N + n)
        common |= {"bias_ptr": w.bias.contiguous(), "HAS_BIAS": True}
    if w.kind == "w4a16":
        qw, scales = w.weight, w.scale
        num_tiles = qw.shape[1] // 16
        # per channel: one power-of-two group past the padded K, so every step lies in group 0
        group_columns = w.group_size if w.group_size > 0 else triton.next_power_of_2(num_tiles * K_TILE)
        qz = w.zeros if w.zeros is not None else scales
        _grouped_w4a16_kernel[grid](
            a, qw, scales, qz, out, sorted_pairs, block_expert, topk_weights, out.shape[0], w.num_experts, n, k,
            scales.shape[1], num_tiles, a.stride(0), qw.stride(0), scales.stride(0), qz.stride(0), out.stride(0),
            GROUP_SIZE=group_columns, HAS_ZEROS=w.zeros is not None, TILES=config.w4_tiles,
            GROUPS=max(config.w4_tiles * K_TILE // group_columns, 1), **common)
        return
    weight, block = w.weight, w.kind == "w8a8-fp8-block"
    scale = w.scale if w.scale is not None else topk_weights
    a_scale_ = a_scale if a_scale is not None else topk_weights
    _grouped_gemm_kernel[grid](
        a, a_scale_, weight, scale, out, sorted_pairs, block_expert, topk_weights, out.shape[0], w.num_experts, n, k,
        a.stride(0), weight.stride(0), weight.stride(1), out.stride(0), a_scale_.stride(0),
        a_scale_.stride(-1) if block else 0, scale.stride(0), scale.stride(1) if block else 0,
        HAS_SCALE=w.scale is not None and not block, HAS_A_SCALE=a_scale is not None and not block,
        GROUP=w.group_size if block else 0, BLOCK_K=min(w.group_size, 128) if block else config.block_k,
        **common)


def _gemm_input(a: Tensor, w: ExpertWeights, local_ids: Tensor, rows_per_pair: int) -> tuple[Tensor, Tensor | None, int]:
    """(input rows, their float32 scales or None, input rows per pair): w8a8-fp8 quantizes the rows
    as its format does — per row (dynamic), or per pair with its expert's static input scale."""
    if w.kind == "w8a8-fp8-block":
        return (*quantize_fp8_per_token_group(a, w.group_size), rows_per_pair)  # scales [rows, G], by their strides
    if w.kind != "w8a8-fp8":
        return a, None, rows_per_pair
    if w.input_scale is None:
        a_fp8, scale = quantize_input_fp8(a, None)
        return a_fp8, scale.reshape(-1).contiguous(), rows_per_pair
    flat = local_ids.flatten()
    expert = flat.clamp(0, w.num_experts - 1)  # other ranks' pairs: any scale, their rows are never read
    scale = w.input_scale.float().reshape(-1)[expert]  # [P]
    rows = a if rows_per_pair == 1 else a.repeat_interleave(rows_per_pair, dim=0)  # [P, K]
    a_fp8, _ = quantize_input_fp8(rows, scale[:, None])
    return a_fp8, scale.contiguous(), 1


def fused_moe(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, gate_up: ExpertWeights, down: ExpertWeights,
              config: MoeConfig | None = None, swiglu: tuple[float, float] | None = None,
              relu2: bool = False) -> Tensor:
    """See kernels/fused_moe.py. x [M, H] → [M, H]; swiglu, relu2: fused_moe.gated_activation's."""
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    config = config or select_moe_config(num_tokens, top_k, gate_up.num_experts, gate_up.kind)
    x = x.contiguous()
    sorted_pairs, block_expert = align_by_expert(topk_ids, gate_up.num_experts, config.block_m)
    weights = topk_weights.float().contiguous().flatten()
    # Rows of other ranks' pairs are never written here nor read by the down GEMM.
    gate_up_out = torch.empty(num_pairs, gate_up.out_features, device=x.device, dtype=x.dtype)  # [P, 2I]
    a, a_scale, rows_per_pair = _gemm_input(x, gate_up, topk_ids, top_k)
    _grouped_gemm(a, a_scale, gate_up, gate_up_out, sorted_pairs, block_expert, weights, rows_per_pair, False, config)
    act = gated_activation(gate_up_out, swiglu, relu2)  # [P, I]
    a, a_scale, _ = _gemm_input(act, down, topk_ids, 1)
    down_out = torch.zeros(num_pairs, down.out_features, device=x.device, dtype=x.dtype)  # [P, H], other ranks' pairs 0
    _grouped_gemm(a, a_scale, down, down_out, sorted_pairs, block_expert, weights, 1, True, config)
    return down_out.view(num_tokens, top_k, -1).sum(dim=1)
