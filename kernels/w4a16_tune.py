"""Measure a W4A16 tuning table once, on the target GPU (never at server start): `llmc build` with
`target.tune_kernels: true` runs it for the artifact's shapes and records the result in the plan.

`tune_w4a16(shapes)` times, for each (K, N) and each M of `ms`, the fused kernel's candidate tiles
and the dequantize + cuBLAS path, checks each candidate's output, and returns the table that
`w4a16_gemm.w4a16_linear(..., table=...)` reads: {"KxN": [(max_m, config, time_us), ...]}.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from . import device_capability, device_num_sms
from .timing import make_l2_flush_buffer, median_time_ms
from .w4a16_gemm import (
    K_TILE, WS_BLOCK_N, W4A16Config, pack_w4a16_for_gpu, run_w4a16_config, wgmma_stages, wgmma_supported,
    ws_stages)

DEFAULT_TUNE_MS = (1, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)


def candidate_configs(m: int, k: int, n: int, num_sms: int, wgmma: bool = False) -> list[W4A16Config]:
    """The configs worth timing at this shape: CUDA-core GEMV and tensor-core tiles for small M,
    larger tiles and dequantize + matmul above; with `wgmma` (a Hopper GPU), the Gluon kernel's."""
    # (kind, block_m, block_n, num_warps, is_stacked)
    if m <= 16:  # (one tl.dot per group lost everywhere here in the first measurements)
        tiles = [("fused", 16, 64, 4, False), ("fused", 16, 128, 4, False), ("fused", 16, 256, 4, False),
                 ("fused", 16, 128, 8, False)]
        if m <= 4:  # (the stacked GEMV beat the per-slice one everywhere)
            block_m = 1 << max(0, m - 1).bit_length()
            tiles += [("gemv", block_m, 64, 4, True), ("gemv", block_m, 128, 4, True),
                      ("gemv", block_m, 128, 8, True), ("gemv", block_m, 256, 8, True)]
    elif m <= 64:
        tiles = [("fused", 32, 64, 4, False), ("fused", 64, 64, 4, False), ("fused", 64, 128, 4, False),
                 ("fused", 32, 128, 4, True), ("fused", 64, 128, 4, True), ("fused", 64, 128, 8, True)]
    else:
        tiles = [("fused", 64, 128, 4, False), ("fused", 128, 128, 8, False),
                 ("fused", 64, 128, 4, True), ("fused", 128, 128, 8, True), ("fused", 128, 256, 8, True)]
    if m <= 128:  # the weight as the tensor cores' register operand
        block_ms = (16,) if m <= 16 else ((32, 64) if m <= 64 else (64, 128))
        tiles += [("swap", bm, bn, 4 if bm * bn < 128 * 128 else 8, False) for bm in block_ms for bn in (64, 128)]
    num_tiles = math.ceil(k / K_TILE)
    configs = [W4A16Config(kind="dequant")] if m > 16 else []
    if m <= 2:  # one token per program row, many K tiles per load (the best of the first sweep)
        configs += [W4A16Config("rows", 1, block_n, split_k, 8, 1, k_tiles=k_tiles)
                    for k_tiles, block_n in ((4, 32), (8, 32), (16, 32), (8, 64)) for split_k in (1, 2, 4)]
    for kind, block_m, block_n, num_warps, is_stacked in tiles:
        num_programs = math.ceil(n / block_n) * math.ceil(m / block_m)
        for split_k in (1, 2, 4, 8, 16):
            if split_k > num_tiles or (split_k > 1 and num_programs * split_k > 8 * num_sms):
                continue
            for num_stages in ((3, 4) if kind == "swap" else (2, 4)) if m <= 16 else (3,):
                configs.append(W4A16Config(kind, block_m, block_n, split_k, num_warps, num_stages, is_stacked))
    return configs + (wgmma_configs(m, k, n, num_sms) if wgmma else [])


def wgmma_configs(m: int, k: int, n: int, num_sms: int) -> list[W4A16Config]:
    """The Gluon kernel's tiles: a token tile from 8 to 256 (the wgmma's N), 64 weight rows per
    warpgroup (or 128 on one warpgroup, to 128 tokens), split-K while the tiles are fewer than the
    SMs, as many ring stages as fit in ~200 KB of shared memory (at most 6), both conversion orders;
    to 64 tokens also the per-tile order with the scale on the products (scale_acc) on 4 stages (the
    table's picks at 64 tokens since session 23), to 32 also the scaled operands on 4 stages, to 8
    tokens also 8-token tiles in that order only (the table's picks up to 8 tokens: H100, session 19); from
    64 tokens the warp-specialized kernel's (128 weight rows)."""
    block_ms = [8] * (m <= 8) + [bm for bm in (16, 32, 64, 128, 256) if bm <= max(16, m) and 2 * bm >= min(m, 256)]
    num_tiles = math.ceil(k / K_TILE)
    configs = []
    for block_m in block_ms:
        # 128 rows on one warpgroup: two 64-row wgmmas per slice (its accumulator fits up to 128 tokens)
        for block_n, num_warps in ((64, 4), (128, 8)) + (((128, 4),) if block_m <= 128 else ()):
            stages = wgmma_stages(block_m, block_n)
            # few tokens: a shallower ring (more programs per SM) and the products scaled per tile
            variants = [(stages, False, False), (stages, True, False)] if block_m > 8 else []
            if block_m <= 64:  # (6 stages with the scale on the products lost to 4 everywhere: session 18)
                variants += [(4, True, True)] + ([(4, True, False)] if stages > 4 and 8 < block_m <= 32 else [])
            num_programs = math.ceil(n / block_n) * math.ceil(m / block_m)
            for split_k in (1, 2, 4, 8):
                if split_k > 1 and (split_k > num_tiles // 2 or num_programs * split_k > 4 * num_sms):
                    continue
                configs += [W4A16Config("wgmma", block_m, block_n, split_k, num_warps, num_stages, per_tile,
                                        scale_acc=scale_acc) for num_stages, per_tile, scale_acc in variants]
        if m >= 64 and block_m >= 64:  # warp-specialized (slower at 1-32 tokens: H100, session 15)
            num_programs = math.ceil(n / WS_BLOCK_N) * math.ceil(m / block_m)
            configs += [W4A16Config("wgmma_ws", block_m, WS_BLOCK_N, split_k, 4, ws_stages(block_m), True)
                        for split_k in (1, 2, 4, 8) if split_k == 1 or (split_k <= num_tiles // 4
                                                                         and num_programs * split_k <= 4 * num_sms)]
    return configs


def _random_packed_weight(k: int, n: int, group_size: int, dtype: torch.dtype, device) -> dict[str, Tensor]:
    num_groups = 1 if group_size == -1 else k // group_size
    levels = torch.randint(0, 16, (n, k), dtype=torch.int32, device=device)
    scales = (torch.rand(n, num_groups, device=device) * 0.02 + 0.005).to(dtype)
    return pack_w4a16_for_gpu(levels, scales, None)


def check_and_time(run: Callable[[], Tensor], expected: Tensor, flush: Tensor | None,
                   label: str) -> tuple[float, float] | None:
    """(median ms of run() with a cold L2, its relative error against `expected`) when it runs and is
    within 1e-2; None, reported under `label`, when it raises (a tile that does not compile or fit on
    this GPU) or is wrong."""
    try:
        error = ((run().float() - expected).norm() / expected.norm()).item()
    except Exception as exc:
        print(f"{label}: {type(exc).__name__}: {str(exc)[:200]}")
        return None
    if not error < 1e-2:
        print(f"{label}: wrong result (relative error {error:.2e})")
        return None
    return median_time_ms(run, flush), error


def tune_w4a16(
    shapes: list[tuple[int, int]],
    ms: tuple[int, ...] = DEFAULT_TUNE_MS,
    dtype: torch.dtype = torch.bfloat16,
    group_size: int = 128,
    records: list | None = None,
) -> dict:
    """{"KxN": [(m, config dict, time_us), ...]}: the fastest correct config per shape and M.

    `records`, if given, receives every timed candidate as {"K", "N", "M", "config", "us"}."""
    from .w4a16_triton import launch_w4a16_dequantize

    device = torch.device("cuda")
    num_sms = device_num_sms(device)
    capability = device_capability(device)
    flush = make_l2_flush_buffer(device)
    table = {}
    for k, n in shapes:
        params = _random_packed_weight(k, n, group_size, dtype, device)
        qweight, scales = params["qweight"], params["scales"]
        wgmma = wgmma_supported(capability, dtype, group_size, k, n)
        entries = []
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=dtype)
            expected = F.linear(x, launch_w4a16_dequantize(qweight, scales, None, k, group_size)).float()

            def run(config: W4A16Config) -> Tensor:
                return run_w4a16_config(x, qweight, scales, None, None, group_size, config)

            timed = []
            for config in candidate_configs(m, k, n, num_sms, wgmma):
                result = check_and_time(lambda c=config: run(c), expected, flush, f"tune {k}x{n} m={m} {config}")
                if result is None:
                    continue
                timed.append((result[0], config))
                if records is not None:
                    records.append({"K": k, "N": n, "M": m, "config": config.to_dict(), "us": round(timed[-1][0] * 1000, 2)})
            if not timed:
                raise RuntimeError(f"no W4A16 config ran correctly for {k}x{n} at M={m}")
            best_ms, best = min(timed, key=lambda item: item[0])
            entries.append((m, best.to_dict(), round(best_ms * 1000, 2)))
        table[f"{k}x{n}"] = entries
    return table
