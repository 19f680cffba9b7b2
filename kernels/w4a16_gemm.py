"""W4A16 GEMM: int4 weights with group scales (and zero points), 16-bit activations, fp32 accumulation.

y [M, N] = x [M, K] @ w.T, w[n, k] = (level[n, k] - zero[n, g]) * scale[n, g], g = k // group_size.

The weights are packed once, at compile time, into the "gpu" layout (`pack_w4a16_for_gpu`):
  qweight [ceil(K / 128) * 16, N] int32   K tile t (128 input columns), word row r (0..15), nibble j
                                          (0..7, least significant first) holds level[n, 128 t + 16 j + r];
                                          K is zero-padded to a whole tile
  scales  [num_groups, N]          dtype  transposed: one contiguous row per group
  qzeros  [num_groups, ceil(N / 8)] int32 only with zero points: nibble j of word w is column 8 w + j
One K tile is one [16, BLOCK_N] int32 load (16-byte vectors along N) and one scale row per group.

Dispatch (`w4a16_linear`; `w4a16_silu_mul` for a gate_up whose rows `interleave_gate_up` reordered,
SiLU(gate) · up in the kernel's epilogue where it is kind "wgmma"): on CUDA the Triton kernels of w4a16_triton.py, with the kernel and its
tile sizes per (K, N, M) read from a tuning table: the one the compiler recorded in the artifact's
plan for its shapes (`w4a16_tune.tune_w4a16` measures one, once, on the build GPU), or, for an
artifact that records none, DEFAULT_W4A16_TABLE and a heuristic for shapes it lacks; on CPU
dequantize + F.linear.
"""

from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from . import can_use_triton, device_capability, device_num_sms
from .activation import GATE_UP_INTERLEAVE, silu_and_mul

K_TILE = 128  # input columns per packed tile
_WORD_ROWS = K_TILE // 8  # int32 word rows per tile
_UINT32_MASK = 0xFFFFFFFF


def gpu_packed_shapes(in_features: int, out_features: int, num_groups: int, is_symmetric: bool) -> dict:
    """name → shape of every tensor of the gpu layout (scales are in the model dtype, the rest int32)."""
    shapes = {
        "qweight": (math.ceil(in_features / K_TILE) * _WORD_ROWS, out_features),
        "scales": (num_groups, out_features),
    }
    if not is_symmetric:
        shapes["qzeros"] = (num_groups, math.ceil(out_features / 8))
    return shapes


def _to_int32(words: Tensor) -> Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_w4a16_for_gpu(levels: Tensor, scales: Tensor, zeros: Tensor | None) -> dict[str, Tensor]:
    """Plain levels [N, K] in [0, 16), scales [N, G] (kept in their dtype), zeros [N, G] levels or None
    (symmetric: zero 8) → the gpu layout's tensors (see the module docstring)."""
    out_features, in_features = levels.shape
    num_tiles = math.ceil(in_features / K_TILE)
    padded = F.pad(levels.to(torch.int64), (0, num_tiles * K_TILE - in_features))  # [N, Kp]
    by_tile = padded.t().reshape(num_tiles, 8, _WORD_ROWS, out_features)  # [t, j, r, N]
    shifts = (4 * torch.arange(8, device=levels.device)).view(1, 8, 1, 1)
    words = (by_tile << shifts).sum(dim=1)  # [t, r, N]
    params = {
        "qweight": _to_int32(words.reshape(num_tiles * _WORD_ROWS, out_features)).contiguous(),
        "scales": scales.t().contiguous(),
    }
    if zeros is not None:
        zeros_t = F.pad(zeros.to(torch.int64).t(), (0, -out_features % 8))  # [G, N padded to 8]
        zero_words = (zeros_t.unflatten(1, (-1, 8)) << (4 * torch.arange(8, device=zeros.device))).sum(-1)
        params["qzeros"] = _to_int32(zero_words).contiguous()  # [G, ceil(N / 8)]
    return params


def unpack_w4a16_from_gpu(
    params: Mapping[str, Tensor], in_features: int
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Inverse of `pack_w4a16_for_gpu`: (levels [N, K] int32, scales [N, G], zeros [N, G] int32 or None)."""
    words = params["qweight"].to(torch.int64) & _UINT32_MASK  # [t * 16, N]
    num_tiles, out_features = words.shape[0] // _WORD_ROWS, words.shape[1]
    shifts = (4 * torch.arange(8, device=words.device)).view(1, 8, 1, 1)
    by_tile = (words.view(num_tiles, 1, _WORD_ROWS, out_features) >> shifts) & 0xF  # [t, j, r, N]
    levels = by_tile.reshape(num_tiles * K_TILE, out_features).t()[:, :in_features]
    scales = params["scales"].t()
    zeros = None
    if "qzeros" in params:
        zero_words = params["qzeros"].to(torch.int64) & _UINT32_MASK  # [G, ceil(N / 8)]
        nibbles = (zero_words.unsqueeze(-1) >> (4 * torch.arange(8, device=words.device))) & 0xF
        zeros = nibbles.flatten(1)[:, :out_features].t().to(torch.int32)
    return levels.to(torch.int32).contiguous(), scales.contiguous(), zeros


def dequantize_w4a16(params: Mapping[str, Tensor], in_features: int, group_size: int) -> Tensor:
    """The weight [N, K] float32 from the gpu layout (the CPU path, and the kernels' test oracle)."""
    levels, scales, zeros = unpack_w4a16_from_gpu(params, in_features)
    group_columns = in_features if group_size == -1 else group_size
    scales = scales.float().repeat_interleave(group_columns, dim=1)[:, :in_features]  # [N, K]
    zeros_f = torch.full_like(scales, 8.0) if zeros is None else zeros.float()
    if zeros is not None:
        zeros_f = zeros_f.repeat_interleave(group_columns, dim=1)[:, :in_features]
    return (levels.float() - zeros_f) * scales


def interleave_gate_up(params: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A gate_up projection in the gpu layout (gate rows, then the same features' up rows) with its
    rows reordered as activation.silu_and_mul's interleaved order (runs of GATE_UP_INTERLEAVE gate rows,
    then the same features' up rows; each run of 8 is one word of qzeros), so that a kernel's tile of
    rows holds both halves of its features (`w4a16_silu_mul`). Needs N a multiple of 16."""
    out_features = params["qweight"].shape[1]
    run = GATE_UP_INTERLEAVE
    if out_features % (2 * run):
        raise ValueError(f"gate_up of {out_features} rows cannot interleave in runs of {run}")
    size = out_features // 2
    runs = torch.arange(size // run, device=params["qweight"].device)
    first = torch.stack([runs * run, size + runs * run], dim=1).flatten()  # each run's first old row
    order = (first[:, None] + torch.arange(run, device=first.device)).flatten()
    interleaved = dict(params)
    interleaved["qweight"] = params["qweight"].index_select(1, order).contiguous()
    interleaved["scales"] = params["scales"].index_select(1, order).contiguous()
    if "qzeros" in params:
        interleaved["qzeros"] = params["qzeros"].index_select(1, first // 8).contiguous()
    return interleaved


@dataclasses.dataclass(frozen=True)
class W4A16Config:
    """How one GEMM shape runs: a Triton kernel with these tiles, or "dequant" (the weight
    dequantized, then torch's matmul). Kernels (w4a16_triton.py): "rows" (one token per program row,
    CUDA cores, `k_tiles` 128-column tiles per load), "gemv" (a few tokens, CUDA cores), "swap"
    (tensor cores, the weight as the register operand), "fused" (tensor cores, the weight through
    shared memory); "wgmma" (w4a16_gluon.py, Hopper only: the swap product with TMA loads and
    asynchronous wgmma, the conversion overlapped with the MMA; is_stacked: a whole tile's operands
    converted while the previous tile multiplies, else one slice at a time); "wgmma_ws" (w4a16_ws.py:
    the per-tile order warp-specialized, a producer warp and two consumer warpgroups of 64 rows each;
    block_n is 128, num_warps and is_stacked do not apply). scale_acc (wgmma per tile only): the
    operands are the exact (level - zero) and the group scale multiplies each tile's products."""

    kind: str = "fused"  # "rows" | "gemv" | "swap" | "fused" | "wgmma" | "wgmma_ws" | "dequant"
    block_m: int = 16
    block_n: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    # fused: one tl.dot per group instead of one per 16 input columns; gemv: one broadcast product
    is_stacked: bool = False
    k_tiles: int = 1  # rows: K tiles loaded at once
    scale_acc: bool = False  # wgmma, is_stacked: the scale applied to each tile's products

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


KINDS = ("rows", "gemv", "swap", "fused", "wgmma", "wgmma_ws", "dequant")
WGMMA_KINDS = ("wgmma", "wgmma_ws")  # the Gluon kernels (Hopper only)
WS_BLOCK_N = 128  # weight rows of a wgmma_ws tile: two consumer warpgroups of 64
_DEQUANT = W4A16Config(kind="dequant")

DEFAULT_W4A16_TABLE_GPU = "NVIDIA H100 80GB HBM3"  # torch.cuda.get_device_name() of the GPU it was measured on

# Measured on an NVIDIA H100 (torch 2.11, triton 3.6, bf16, group size 128): by `tune_w4a16`
# (benchmarks/bench_kernels.py --tune) up to 32 tokens in session 12 (call 4); at 64 tokens the faster of
# session 12's entry and the best warp-specialized candidate of the tuner, timed in one run (session 14,
# call 13, `benchmarks/w4a16_kind_sweep.py --kind wgmma_ws`); from 128 tokens in session 15 (call 2,
# `--tune-ms 128 256 512 1024 4096`, the warp-specialized kernel staggered); up to 32 tokens the fastest of
# the session-12 entry and eight per-tile configs with 4 stages, mostly the scale on the products, timed in
# one run (session 18, calls 4 and 8, `benchmarks/w4a16_kind_sweep.py --ms ... --configs ...`); up to 8
# tokens 8-token tiles where one was at least 2% faster than the entry in the same run (session 19, call 3:
# all of them at 4 and 8 tokens, and qkv at one; o's 8-token tile at one token, 3% faster in call 3, was
# 2% slower in call 5's repeat and is not kept); gate_up's 16-token entry takes the scale on the products
# once its scales came with the words (session 22, call 7: 32.22 -> 29.25 us); the 64-token entries take the
# scale on the products too, the fastest of eight such configs in one run (session 23, call 6: 1.09-1.30x
# faster than the entries before); qkv from 1025 tokens the warp-specialized tile once its tiles left by TMA
# stores (session 25, call 10: 267.1 us against 281.6 for dequantize + cuBLAS in the same run); qkv at
# 513-1024 tokens and gate_up beyond 1024 the warp-specialized tiles too, each faster than dequantize +
# cuBLAS in both rounds of session 26's call 1 and again in its call 2 (qkv 88.8-88.9 against 91.7-92.0
# us, gate_up 1286-1338 against 1349-1351); the warp-specialized entries' times are the medians of that
# call's two rounds (`benchmarks/w4a16_kind_sweep.py --kind wgmma_ws --ms 128 256 512 1024 4096`);
# see benchmarks/RESULTS.md.
# Llama-3-8B linears (K×N).
# {"KxN": ((max_m, config, measured_us), ...)}: the first entry whose max_m >= M applies, the last
# one beyond. A table from tune_w4a16 (JSON) has config dicts in place of W4A16Config.
DEFAULT_W4A16_TABLE: Mapping[str, tuple] = MappingProxyType(
    {
        "4096x6144": (
            (1, W4A16Config("wgmma", 8, 64, 4, 4, 4, True, scale_acc=True), 13.57),
            (4, W4A16Config("wgmma", 8, 64, 4, 4, 4, True, scale_acc=True), 13.34),
            (8, W4A16Config("wgmma", 8, 64, 4, 4, 4, True, scale_acc=True), 14.21),
            (16, W4A16Config("wgmma", 16, 64, 4, 4, 4, True, scale_acc=True), 14.59),
            (32, W4A16Config("wgmma", 32, 64, 4, 4, 4, True, scale_acc=True), 15.3),
            (64, W4A16Config("wgmma", 64, 64, 2, 4, 4, True, scale_acc=True), 18.69),
            (128, W4A16Config("wgmma_ws", 128, 128, 2, 4, 5, True), 25.57),
            (256, W4A16Config("wgmma_ws", 128, 128, 1, 4, 5, True), 34.4),
            (512, W4A16Config("wgmma_ws", 256, 128, 1, 4, 3, True), 46.91),
            (1024, W4A16Config("wgmma_ws", 128, 128, 1, 4, 5, True), 88.87),
            (4096, W4A16Config("wgmma_ws", 256, 128, 1, 4, 3, True), 266.92),
        ),
        "4096x4096": (
            (1, W4A16Config("wgmma", 16, 128, 8, 4, 4, True, scale_acc=True), 12.0),
            (4, W4A16Config("wgmma", 8, 128, 8, 8, 4, True, scale_acc=True), 12.38),
            (8, W4A16Config("wgmma", 8, 128, 8, 8, 4, True, scale_acc=True), 12.8),
            (16, W4A16Config("wgmma", 16, 64, 4, 4, 4, True, scale_acc=True), 13.41),
            (32, W4A16Config("wgmma", 32, 64, 4, 4, 4, True, scale_acc=True), 13.7),
            (64, W4A16Config("wgmma", 64, 64, 2, 4, 4, True, scale_acc=True), 14.94),
            (128, W4A16Config("wgmma", 128, 64, 2, 4, 5, True), 19.58),
            (256, W4A16Config("wgmma", 128, 64, 1, 4, 5, True), 25.5),
            (512, W4A16Config("wgmma_ws", 128, 128, 1, 4, 5, True), 33.99),
            (1024, W4A16Config("wgmma_ws", 256, 128, 1, 4, 3, True), 49.09),
            (4096, W4A16Config("wgmma_ws", 256, 128, 1, 4, 3, True), 180.16),
        ),
        "4096x28672": (
            (1, W4A16Config("wgmma", 16, 128, 1, 4, 4, True, scale_acc=True), 30.66),
            (4, W4A16Config("wgmma", 8, 128, 1, 4, 4, True, scale_acc=True), 30.72),
            (8, W4A16Config("wgmma", 8, 128, 1, 4, 4, True, scale_acc=True), 30.34),
            (16, W4A16Config("wgmma", 16, 128, 1, 4, 4, True, scale_acc=True), 29.25),
            (32, W4A16Config("wgmma", 32, 128, 1, 4, 4, True, scale_acc=True), 33.3),
            (64, W4A16Config("wgmma", 64, 128, 1, 4, 4, True, scale_acc=True), 40.83),
            (128, W4A16Config("wgmma_ws", 128, 128, 1, 4, 5, True), 63.68),
            (256, W4A16Config("wgmma_ws", 256, 128, 1, 4, 3, True), 93.2),
            (512, W4A16Config("wgmma_ws", 256, 128, 1, 4, 3, True), 180.27),
            (1024, W4A16Config("wgmma_ws", 256, 128, 1, 4, 3, True), 315.63),
            (4096, W4A16Config("wgmma_ws", 256, 128, 1, 4, 3, True), 1311.82),
        ),
        "14336x4096": (
            (1, W4A16Config("wgmma", 16, 128, 8, 4, 4, True, scale_acc=True), 19.74),
            (4, W4A16Config("wgmma", 8, 128, 8, 4, 4, True, scale_acc=True), 19.84),
            (8, W4A16Config("wgmma", 8, 64, 8, 4, 4, True, scale_acc=True), 20.35),
            (16, W4A16Config("wgmma", 16, 64, 8, 4, 4, True, scale_acc=True), 22.05),
            (32, W4A16Config("wgmma", 32, 128, 8, 4, 4, True, scale_acc=True), 22.8),
            (64, W4A16Config("wgmma", 64, 64, 4, 4, 4, True, scale_acc=True), 27.65),
            (128, W4A16Config("wgmma_ws", 128, 128, 4, 4, 5, True), 38.42),
            (256, W4A16Config("wgmma_ws", 256, 128, 4, 4, 3, True), 53.95),
            (512, W4A16Config("wgmma_ws", 256, 128, 2, 4, 3, True), 88.72),
            (1024, W4A16Config("wgmma_ws", 256, 128, 1, 4, 3, True), 150.16),
            (4096, W4A16Config("wgmma_ws", 256, 128, 1, 4, 3, True), 585.6),
        ),
    }
)


def heuristic_w4a16_config(m: int, k: int, n: int, num_sms: int, wgmma: bool = True) -> W4A16Config:
    """A config for shapes no table covers. With `wgmma` (a Hopper GPU, the plan's assumption), after
    the H100 sweeps of the Gluon kernel: its 8- to 256-token tiles up to 1024 tokens while the tiles
    fill the GPU (to 64 tokens per tile with the scale on the products, from 128 tokens the
    warp-specialized kernel), one token per program row for small weights at one token; beyond 1024
    tokens the warp-specialized kernel or dequantize + matmul (_many_tokens_config); without, the
    Triton kernels' rule. The config is
    the one for the top of M's bucket (_HEURISTIC_MAX_MS), so heuristic_w4a16_entries reproduces it
    at every M."""
    bucket = next((b for b in _HEURISTIC_MAX_MS if m <= b), _HEURISTIC_MAX_MS[-1])  # the last one beyond
    if not wgmma or (bucket == 1 and n * k <= 32 * 2**20):
        return _triton_heuristic(m, k, n, num_sms)
    if bucket > 1024:
        return _many_tokens_config(bucket, k, n, num_sms)
    # 8-token tiles up to 8 tokens (H100, session 19: the Llama-3-8B table's picks there; on four other
    # shapes 1.00-1.11x the 16-token tile, benchmarks/w4a16_heuristic_check.py)
    block_m = 8 if bucket <= 8 else min(bucket, 256)
    block_n, num_warps = (64, 4) if block_m in (8, 16, 64) else ((128, 4) if block_m == 32 else (128, 8))
    # few tokens and a weight of at least one 128-row tile per SM: 128 rows per program, no split
    # (H100, session 12: gate_up at 1-16 tokens 32 µs against 36 µs with 64 rows; session 24: at 64 tokens)
    is_wide = block_m <= 64 and math.ceil(n / 128) >= num_sms
    if is_wide:
        block_n = 128
    num_programs = math.ceil(n / block_n) * math.ceil(bucket / block_m)
    if bucket > 256 and num_programs < (2 * num_sms if bucket > 512 else num_sms // 2):
        return _DEQUANT  # too few tiles to fill the GPU: cuBLAS on the dequantized weight wins
    # split K in two until 2 programs per SM (16-token tiles, bound by the weights' bytes) or 1 (larger
    # ones, bound by the MMA), at most 4 per SM, at least 8 K tiles per split: within 5% of the best
    # measured tiles on average over the sweep's 44 cells (H100, Llama-3-8B shapes), 26% at worst
    target = 2 * num_sms if block_m <= 16 and not is_wide else num_sms
    num_tiles, split_k = math.ceil(k / K_TILE), 1
    while num_programs * split_k < target and split_k * 2 <= num_tiles // 8 and num_programs * split_k * 2 <= 4 * num_sms:
        split_k *= 2
    if block_m >= 128:  # warp-specialized, the same tile (the tuner's pick in 13 of 16 entries there)
        return W4A16Config("wgmma_ws", block_m, WS_BLOCK_N, split_k, 4, ws_stages(block_m), True)
    # per tile, the products scaled per tile, 4 stages (session 18, H100: the Llama-3-8B table entries 3-11%
    # faster at 1-32 tokens, other shapes' tiles 1.03-1.8x; session 24: at 64 tokens 1.14-1.59x the per-slice
    # 128-row tile this rule took before, on eight shapes, within 16% of the best of six such tiles)
    return W4A16Config("wgmma", block_m, block_n, split_k, num_warps, 4, True, scale_acc=True)


def _many_tokens_config(m: int, k: int, n: int, num_sms: int) -> W4A16Config:
    """Beyond 1024 tokens: the warp-specialized 256-token tile where its tiles fill their last wave to at
    least 85% and K has at least 16 tiles, else dequantize + cuBLAS. H100, session 25 (after the TMA-store
    epilogue), 2048 and 4096 tokens on five shapes: the tile 1.01-1.14x faster than dequantize + cuBLAS
    in the 7 cells this gives it; dequantize + cuBLAS 1.08-1.12x faster in 2 of the 3 it keeps
    (13824x5120 at 2048 tokens, 81% of the last wave; K = 1024 at 4096 tokens) and even in the third.
    Two shapes decide the two thresholds (benchmarks/RESULTS.md)."""
    tiles = math.ceil(n / WS_BLOCK_N) * math.ceil(m / 256)
    fill = tiles / (math.ceil(tiles / num_sms) * num_sms)
    if k >= 16 * K_TILE and fill >= 0.85:
        return W4A16Config("wgmma_ws", 256, WS_BLOCK_N, 1, 4, ws_stages(256), True)
    return _DEQUANT


def _triton_heuristic(m: int, k: int, n: int, num_sms: int) -> W4A16Config:
    """The Triton kernels' rule (any GPU): one token per program row with 8 K tiles per load, the
    swapped tensor-core tiles to 64 tokens, dequantize + matmul above; split-K until about two
    programs per SM."""
    if m > 64:
        return _DEQUANT
    if m == 1:
        kind, block_m, block_n, num_warps, num_stages = "rows", 1, 32, 8, 1
    else:
        kind, block_m, num_warps, num_stages = "swap", 16 if m <= 16 else 64, 4, 3
        block_n = 128 if m > 16 or n >= 16384 else 64
    num_programs = math.ceil(n / block_n) * math.ceil(m / block_m)
    num_tiles = math.ceil(k / K_TILE)
    split_k = 1
    while num_programs * split_k < 2 * num_sms and split_k * 2 <= num_tiles // 2:
        split_k *= 2
    return W4A16Config(kind, block_m, block_n, split_k, num_warps, num_stages, k_tiles=8 if kind == "rows" else 1)


# The M at which heuristic_w4a16_config changes (the Triton rule's bounds, 1, 16, 64, are among them;
# its split-K depends on ceil(M / block_m), which is 1 up to each bound).
_HEURISTIC_MAX_MS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def heuristic_w4a16_entries(k: int, n: int, num_sms: int) -> list[tuple[int, W4A16Config, None]]:
    """The heuristic (for a Hopper GPU) as table entries [(max_m, config, None: not measured)]: the
    table lookup gives the heuristic's config at every M (a GPU without wgmma replaces those
    entries with the Triton rule when they run)."""
    return [(m, heuristic_w4a16_config(m, k, n, num_sms), None) for m in _HEURISTIC_MAX_MS]  # the last beyond


def parse_w4a16_table(table: Mapping) -> Mapping[str, tuple]:
    """A JSON table ({"KxN": [[max_m, config dict, us or null], ...]}) → the lookup's form: entries
    sorted by max_m, configs as W4A16Config. A malformed entry raises TypeError or ValueError."""
    parsed = {}
    for shape, entries in table.items():
        rows = [(int(m), config if isinstance(config, W4A16Config) else W4A16Config(**config), us)
                for m, config, us in entries]
        if not rows or any(config.kind not in KINDS for _, config, _ in rows):
            raise ValueError(f"{shape}: no entries, or an unknown kernel kind")
        if any(config.scale_acc and (config.kind != "wgmma" or not config.is_stacked) for _, config, _ in rows):
            raise ValueError(f"{shape}: scale_acc applies to kind wgmma with is_stacked only")
        if any(config.kind == "wgmma_ws" and config.block_n != WS_BLOCK_N for _, config, _ in rows):
            raise ValueError(f"{shape}: kind wgmma_ws has {WS_BLOCK_N} weight rows per tile: set block_n to {WS_BLOCK_N}")
        parsed[shape] = tuple(sorted(rows, key=lambda row: row[0]))
    return MappingProxyType(parsed)


def select_w4a16_config(m: int, k: int, n: int, table: Mapping | None, num_sms: int) -> W4A16Config:
    """The table's config for (K, N) and the smallest tuned M >= m; the heuristic for unknown shapes."""
    entries = (DEFAULT_W4A16_TABLE if table is None else table).get(f"{k}x{n}")
    if not entries:
        return heuristic_w4a16_config(m, k, n, num_sms)
    entries = sorted(entries, key=lambda entry: entry[0])
    chosen = next((entry[1] for entry in entries if m <= entry[0]), entries[-1][1])
    return chosen if isinstance(chosen, W4A16Config) else W4A16Config(**chosen)


def wgmma_stages(block_m: int, block_n: int) -> int:
    """Ring stages of the Gluon kernel that fit in ~200 KB of shared memory (at most 6): a stage holds
    a tile's packed words [16, block_n] int32 and its activations [block_m, 128] in 16 bits."""
    return min(6, 200 * 1024 // (16 * block_n * 4 + block_m * K_TILE * 2))


def ws_stages(block_m: int) -> int:
    """Ring stages of the warp-specialized kernel in 224 KB of shared memory (at most 6)."""
    return min(6, 224 * 1024 // (16 * WS_BLOCK_N * 4 + block_m * K_TILE * 2))


def wgmma_supported(capability: tuple[int, int], dtype: torch.dtype, group_size: int, k: int, n: int) -> bool:
    """Whether kind "wgmma" runs here: a Hopper GPU (sm_90), 16-bit activations, groups of whole
    128-column tiles or one per channel, and rows the TMA can address (16-byte multiples)."""
    return (capability[0] == 9 and dtype in (torch.bfloat16, torch.float16)
            and (group_size == -1 or group_size % K_TILE == 0) and k % 8 == 0 and n % 4 == 0)


def w4a16_linear(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    qzeros: Tensor | None,
    bias: Tensor | None,
    group_size: int,
    table: Mapping | None = None,
) -> Tensor:
    """x [..., K] → [..., N] in x's dtype, weights in the gpu layout (`pack_w4a16_for_gpu`)."""
    return _w4a16_product(x, qweight, scales, qzeros, bias, group_size, table, silu_mul=False)


def w4a16_silu_mul(
    x: Tensor,
    qweight: Tensor,
    scales: Tensor,
    qzeros: Tensor | None,
    bias: Tensor | None,
    group_size: int,
    table: Mapping | None = None,
) -> Tensor:
    """SiLU(gate) · up [..., N / 2] of a gate_up projection in the gpu layout with its rows in
    `interleave_gate_up`'s order: made in the GEMV's epilogue where the table's kernel is kind "wgmma",
    else by activation.silu_and_mul after w4a16_linear's product (the same bits either way)."""
    return _w4a16_product(x, qweight, scales, qzeros, bias, group_size, table, silu_mul=True)


def _w4a16_product(x, qweight, scales, qzeros, bias, group_size, table, silu_mul: bool) -> Tensor:
    in_features = x.shape[-1]
    if not can_use_triton(x):
        params = {"qweight": qweight, "scales": scales} | ({"qzeros": qzeros} if qzeros is not None else {})
        weight = dequantize_w4a16(params, in_features, group_size).to(x.dtype)  # [N, K]
        y = F.linear(x, weight, bias)
        return silu_and_mul(y, GATE_UP_INTERLEAVE) if silu_mul else y
    return _w4a16_linear_cuda(x, qweight, scales, qzeros, bias, group_size, table, silu_mul)


def _w4a16_linear_cuda(x, qweight, scales, qzeros, bias, group_size, table, silu_mul) -> Tensor:
    in_features, n = x.shape[-1], qweight.shape[1]
    out_features = n // 2 if silu_mul else n
    x2 = x.reshape(-1, in_features)  # [M, K]
    if x2.shape[0] == 0:
        return x.new_empty(*x.shape[:-1], out_features)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    config = select_w4a16_config(x2.shape[0], in_features, n, table, device_num_sms(x.device))
    if config.kind in WGMMA_KINDS and not wgmma_supported(
            device_capability(x.device), x.dtype, group_size, in_features, n):
        # a table measured on a Hopper GPU, read elsewhere (or for other groups / dtypes)
        config = heuristic_w4a16_config(x2.shape[0], in_features, n, device_num_sms(x.device), wgmma=False)
    if x.dtype == torch.float32 and config.kind == "fused":
        # float32 activations are a checking mode (no fp32 tensor-core path is tuned): the weight is
        # dequantized and multiplied in fp32, exactly, as on the CPU.
        config = _DEQUANT
    y = run_w4a16_config(x2, qweight, scales, qzeros, bias, group_size, config, silu_mul)
    return y.reshape(*x.shape[:-1], out_features)


def run_w4a16_config(x, qweight, scales, qzeros, bias, group_size: int, config: W4A16Config,
                     silu_mul: bool = False) -> Tensor:
    """x [M, K] (unit stride along K, on CUDA) → [M, N] by the kernel `config` names, as given (the
    dispatch and the tuner both run configs through here); `silu_mul`: w4a16_silu_mul's product."""
    from . import w4a16_triton  # triton loads on the first CUDA call only

    if config.kind in WGMMA_KINDS and x.data_ptr() % 16:
        x = x.clone()  # the TMA reads from a 16-byte aligned base
    if config.kind == "wgmma":
        from .w4a16_gluon import launch_w4a16_wgmma

        return launch_w4a16_wgmma(x, qweight, scales, qzeros, bias, group_size, config.block_m, config.block_n,
                                  config.split_k, config.num_warps, config.num_stages, config.is_stacked,
                                  config.scale_acc, silu_mul)
    if config.kind == "dequant":
        weight = w4a16_triton.launch_w4a16_dequantize(qweight, scales, qzeros, x.shape[1], group_size)
        y = F.linear(x, weight.to(x.dtype), bias)  # the same matmul as an unquantized layer
    elif config.kind == "wgmma_ws":
        from .w4a16_ws import launch_w4a16_ws

        y = launch_w4a16_ws(x, qweight, scales, qzeros, bias, group_size, config.block_m, config.split_k,
                            config.num_stages)
    else:
        y = w4a16_triton.launch_w4a16_gemm(
            x, qweight, scales, qzeros, bias, group_size, config.kind, config.block_m, config.block_n,
            config.split_k, config.num_warps, config.num_stages, config.is_stacked, config.k_tiles,
        )
    return silu_and_mul(y, GATE_UP_INTERLEAVE) if silu_mul else y
