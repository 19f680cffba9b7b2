"""Fused mixture-of-experts MLP: tokens sorted by expert, one grouped GEMM for gate_up and one for
down, the routing weights applied in the down GEMM and the top-k copies summed.

Shapes: x [M, H]; topk_weights [M, k] float32; topk_ids [M, k] int64, local expert indices (ids
outside [0, E) belong to another rank's experts and contribute nothing). Each projection's experts
are one `ExpertWeights` (gate_up: N = 2I, K = H; down: N = H, K = I), in one of four kinds:
  dense     weight [E, N, K] in x's dtype
  fp8       weight-only FP8: weight [E, N, K] float8_e4m3fn, scale [E, N] float32 (value = fp8 · scale),
            widened to x's dtype in registers
  w4a16     the gpu layout of kernels/w4a16_gemm.py stacked on experts: weight = qweight
            [E, ceil(K/128)·16, N] int32, scale = scales [E, G, N] (x's dtype), zeros = qzeros
            [E, G, ceil(N/8)] int32 or None (symmetric: zero level 8); unpacked in registers
  w8a8-fp8  weight [E, N, K] float8_e4m3fn, scale [E, N] float32, and the input quantized to FP8 as
            the w8a8-fp8 format does: per row (dynamic; gate_up: once per token, down: once per pair)
            or with each expert's calibrated input_scale [E] (static); FP8 × FP8 dot, the row and
            channel scales applied to the float32 accumulator
  w8a8-fp8-block  weight [E, N, K] float8_e4m3fn, scale [E, N, ceil(K / group_size)] float32 (the
            w8a8-fp8-block format's per-row layout of its 128 x 128 blocks), the input quantized per row
            and group_size columns as that format does; each group's FP8 × FP8 product scaled into
            the float32 accumulator by its row's and its channel's group scales
Each projection may carry a bias [E, N] in x's dtype (gpt-oss), added to its output before the routing weight.
The activation between the GEMMs is SiLU(gate) · up, or gpt-oss's clamped SwiGLU (`swiglu` (alpha, limit):
`gated_activation`), or (`relu2`: Nemotron-H's experts, without gate: gate_up holds up's I rows alone, N = I)
relu(up)². Output [M, H] in x's dtype.

`align_by_expert` is plain torch and never synchronises with the host (no .item(), no boolean
indexing), so the whole op can be captured in a CUDA graph: its buffers have static sizes, bounded
by M·k + E·(block_m − 1) sorted slots; block_m comes from the tile table by M, k, E and the experts'
kind only. On CPUs, `fused_moe_reference` is the same computation, expert by expert.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from . import can_use_triton
from .activation import silu_and_mul
from .fp8 import cast_to_fp8, expand_group_scales, quantize_fp8_per_token, quantize_fp8_per_token_group
from .w4a16_gemm import dequantize_w4a16

KINDS = ("dense", "fp8", "w4a16", "w8a8-fp8", "w8a8-fp8-block")


@dataclass(frozen=True)
class ExpertWeights:
    """One projection of every (local) expert, in the form the kernel reads (module docstring)."""

    weight: Tensor
    kind: str = "dense"
    scale: Tensor | None = None
    zeros: Tensor | None = None  # w4a16 asymmetric only
    group_size: int = -1  # w4a16, w8a8-fp8-block: input columns per group (w4a16: -1 one group per output channel)
    in_features: int | None = None  # w4a16: K (qweight's rows are K padded to whole 128-column tiles)
    input_scale: Tensor | None = None  # w8a8-fp8 static: [E] float32; None: dynamic per row
    bias: Tensor | None = None  # [E, N] in x's dtype (gpt-oss), added to each expert's output; None: none

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown expert weight kind {self.kind!r}; known: {KINDS}")
        if self.kind != "dense" and self.scale is None:
            raise ValueError(f"{self.kind} expert weights need their scales")
        if self.kind == "w4a16" and self.in_features is None:
            raise ValueError("w4a16 expert weights need in_features")
        if self.kind == "w8a8-fp8-block" and self.group_size < 1:
            raise ValueError("w8a8-fp8-block expert weights need their group_size")

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    @property
    def out_features(self) -> int:
        return self.weight.shape[2] if self.kind == "w4a16" else self.weight.shape[1]


@dataclass(frozen=True)
class MoeConfig:
    """Tiles of the grouped GEMMs. block_m: sorted slots per program (each expert's run is padded
    to it); block_k: input columns per step (dense, FP8); w4_tiles: packed 128-column tiles per
    step (w4a16, in place of block_k)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    w4_tiles: int = 1


# The tiles by the gate_up experts' kind, measured (`benchmarks/bench_moe.py --sweep` on an H200: every SWEEP candidate
# at Mixtral-8x7B's and Qwen3-30B-A3B's expert shapes, 1 / 16 / 128 / 1024 tokens, timed as a decode step pays it,
# inside a CUDA graph): the first entry whose bound is >= the mean (token, expert) pairs per expert (M·k / E) applies.
#  decode (a few pairs per expert): the weights are read once, so the tile is shaped for bandwidth: the fewest padded
#    rows, wide K steps and deep pipelining (a step of bf16 16 × 64 × 128 is 16 KB, of two packed int4 tiles 8 KB).
#    Within 3-4% of the best candidate for dense, FP8 and block FP8 (session 44; 10% for bf16 Mixtral at 1 token).
#  between (9-48 pairs; Mixtral at 128 tokens): 64 × 128 tiles of 4 warps took 0.80 (FP8) and 0.85 (bf16) of the 32 × 64
#    tiles' time the table had chosen by reasoning, and block FP8's 567 µs against 764 (session 44).
#  prefill: 64 × 128 tiles, K steps of 64, 8 warps for dense and FP8 (within 4% of the best); block FP8 keeps the
#    4-warp tiles (its K steps are one 128-column group each, fused_moe_triton: 1751 µs against 2382 for Mixtral at
#    1024 tokens).
#  w4a16 (session 45, `results/session45/call1.sh`): two packed tiles per K step only below one pair per expert
#    (Mixtral at 1 token 307 µs against one tile's 352, Qwen3 116 against 128); from one pair to 8 one tile
#    (Qwen3 at 16 and 128 tokens 269 and 392 µs against 300 and 444; Mixtral at 16 tokens 707 against 776); above
#    8 the 4-warp 64 × 128 tiles (Mixtral at 128 tokens 856 µs against the 32 × 64 tiles' 1531, at 1024 3276
#    against 3419; Qwen3 at 1024 697 against 724).
_DECODE = MoeConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4, w4_tiles=2)
_WIDE = MoeConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3)
_PREFILL = MoeConfig(block_m=64, block_n=128, block_k=64, num_warps=8, num_stages=3)
_DENSE_AND_FP8 = ((8, _DECODE), (48, _WIDE), (float("inf"), _PREFILL))
MOE_CONFIGS: dict[str, tuple[tuple[float, MoeConfig], ...]] = {
    "dense": _DENSE_AND_FP8,
    "w8a8-fp8": _DENSE_AND_FP8,
    "fp8": _DENSE_AND_FP8,  # weight-only FP8, not swept: its products run in the activations' dtype, as dense's
    "w8a8-fp8-block": ((8, _DECODE), (float("inf"), _WIDE)),
    "w4a16": ((0.5, _DECODE), (8, replace(_DECODE, w4_tiles=1)), (float("inf"), _WIDE)),
}


def select_moe_config(num_tokens: int, top_k: int, num_experts: int, kind: str = "dense") -> MoeConfig:
    """The tiles for this many tokens and the gate_up experts' kind (static per batch size, so CUDA graphs keep their
    sizes)."""
    pairs_per_expert = num_tokens * top_k / max(num_experts, 1)
    return next(config for bound, config in MOE_CONFIGS[kind] if pairs_per_expert <= bound)


def align_by_expert(topk_ids: Tensor, num_experts: int, block_m: int = 16) -> tuple[Tensor, Tensor]:
    """(sorted_pairs [S] int32, block_expert [S / block_m] int32), S = round_up(P + E·(block_m − 1), block_m),
    P = M·k. sorted_pairs lists pair indices p (token p // k, slot p % k) expert by expert, each expert's
    run padded to a multiple of block_m with P (no pair); block_expert gives each block's expert, E
    for blocks past the last run (skipped)."""
    flat = topk_ids.flatten()
    num_pairs = flat.numel()
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # other ranks' experts → E
    order = torch.argsort(key, stable=True)  # [P] pair indices, by expert
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts:].zero_()  # dropped pairs get no slots (a device fill: no host copy under graph capture)
    padded_start = torch.cumsum(padded, 0) - padded
    start = torch.cumsum(counts, 0) - counts
    num_slots = -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_key = key[order]
    slot = padded_start[sorted_key] + torch.arange(num_pairs, device=flat.device) - start[sorted_key]
    slot = torch.where(sorted_key < num_experts, slot, num_slots)  # dropped: the dump slot past the end
    sorted_pairs = torch.full((num_slots + 1,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs.scatter_(0, slot, order.to(torch.int32))
    ends = torch.cumsum(padded[:num_experts], 0)
    blocks = torch.arange(num_slots // block_m, device=flat.device) * block_m
    block_expert = torch.searchsorted(ends, blocks, right=True).to(torch.int32)  # E past the last run
    return sorted_pairs[:num_slots], block_expert


def fused_moe_experts(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, gate_up: ExpertWeights,
                      down: ExpertWeights, config: MoeConfig | None = None,
                      swiglu: tuple[float, float] | None = None, relu2: bool = False) -> Tensor:
    """The MoE MLP of x [M, H] (module docstring): Triton on CUDA, else the torch reference.
    config: the tiles (default: the table's for M); ignored by the reference. swiglu: (alpha, limit) of gpt-oss's
    clamped SwiGLU (`gated_activation`); relu2: gateless experts, relu(up)²; neither: SiLU(gate) · up."""
    if not can_use_triton(x):
        return fused_moe_reference(x, topk_weights, topk_ids, gate_up, down, swiglu=swiglu, relu2=relu2)
    from . import fused_moe_triton  # triton loads on the first CUDA call only

    return fused_moe_triton.fused_moe(x, topk_weights, topk_ids, gate_up, down, config, swiglu, relu2)


def gated_activation(gate_up: Tensor, swiglu: tuple[float, float] | None = None, relu2: bool = False) -> Tensor:
    """An expert's gate_up output [n, 2I] (gate columns, then up) → down's input [n, I]: SiLU(gate) · up, or with
    `swiglu` (alpha, limit) gpt-oss's clamped SwiGLU, (clamp(up, -limit, limit) + 1) · g · sigmoid(alpha · g) with
    g = clamp(gate, max=limit), in gate_up's dtype as transformers' GptOssExperts computes it. With `relu2`
    (Nemotron-H's experts, no gate) gate_up is up's output alone [n, I]: relu(up)²."""
    if relu2:
        return torch.relu(gate_up).square()
    if swiglu is None:
        return silu_and_mul(gate_up)
    alpha, limit = swiglu
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    return (up.clamp(-limit, limit) + 1) * (gate * torch.sigmoid(gate * alpha))


def fused_moe(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, w_gate_up: Tensor, w_down: Tensor,
              gate_up_scale: Tensor | None = None, down_scale: Tensor | None = None,
              config: MoeConfig | None = None) -> Tensor:
    """`fused_moe_experts` for dense weights, or weight-only FP8 ones with per-channel scales."""
    return fused_moe_experts(x, topk_weights, topk_ids, _plain(w_gate_up, gate_up_scale), _plain(w_down, down_scale), config)


def _plain(weight: Tensor, scale: Tensor | None) -> ExpertWeights:
    return ExpertWeights(weight) if scale is None else ExpertWeights(weight, "fp8", scale)


def fused_moe_reference(x: Tensor, topk_weights: Tensor, topk_ids: Tensor, gate_up: ExpertWeights | Tensor,
                        down: ExpertWeights | Tensor, gate_up_scale: Tensor | None = None,
                        down_scale: Tensor | None = None, swiglu: tuple[float, float] | None = None,
                        relu2: bool = False) -> Tensor:
    """Expert by expert in plain torch, in x's dtype (float32 accumulation for FP8 weights). Plain
    tensors (and scales) are dense or weight-only FP8 experts, as for `fused_moe`."""
    gate_up = gate_up if isinstance(gate_up, ExpertWeights) else _plain(gate_up, gate_up_scale)
    down = down if isinstance(down, ExpertWeights) else _plain(down, down_scale)
    out = torch.zeros_like(x)
    for expert in range(gate_up.num_experts):
        token, slot = torch.where(topk_ids == expert)
        if token.numel() == 0:
            continue
        y = expert_linear(gated_activation(expert_linear(x[token], gate_up, expert), swiglu, relu2), down, expert)
        out.index_add_(0, token, y * topk_weights[token, slot, None].to(y.dtype))
    return out


def expert_linear(x: Tensor, w: ExpertWeights, expert: int) -> Tensor:
    """x [n, K] through one expert's weights (and its bias) → [n, N] in x's dtype (the reference's linear)."""
    out = _expert_product(x, w, expert)
    return out if w.bias is None else out + w.bias[expert].to(out.dtype)


def _expert_product(x: Tensor, w: ExpertWeights, expert: int) -> Tensor:
    if w.kind == "w8a8-fp8-block":
        x_fp8, x_scale = quantize_fp8_per_token_group(x, w.group_size)
        size = x.shape[-1]
        weight = w.weight[expert].float() * expand_group_scales(w.scale[expert].float(), w.group_size, size)
        return F.linear(x_fp8.float() * expand_group_scales(x_scale.float(), w.group_size, size), weight).to(x.dtype)
    if w.kind == "w8a8-fp8":
        x_fp8, x_scale = quantize_input_fp8(x, None if w.input_scale is None else w.input_scale[expert].reshape(1))
        weight = w.weight[expert].float() * w.scale[expert].float()[:, None]
        return F.linear(x_fp8.float() * x_scale, weight).to(x.dtype)
    if w.kind == "w4a16":
        params = {"qweight": w.weight[expert], "scales": w.scale[expert]}
        params |= {} if w.zeros is None else {"qzeros": w.zeros[expert]}
        return F.linear(x, dequantize_w4a16(params, w.in_features, w.group_size).to(x.dtype))
    weight = w.weight[expert].to(x.dtype) if w.kind == "dense" else w.weight[expert].float() * w.scale[expert].float()[:, None]
    return F.linear(x, weight.to(x.dtype))


def quantize_input_fp8(x: Tensor, input_scale: Tensor | None) -> tuple[Tensor, Tensor]:
    """w8a8-fp8's activation quantization: per row (input_scale None) → scale [..., 1], or with a
    static scale per row [..., 1] (or one [1]): fp8 = x / scale saturated to ±448."""
    if input_scale is None:
        return quantize_fp8_per_token(x)
    scale = input_scale.float()
    return cast_to_fp8(x, scale), scale

