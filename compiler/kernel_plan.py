"""The W4A16 kernel table the compiler records in the plan: for every GEMM shape of this artifact,
which kernel (and tiles) runs at which M, so the runtime never tunes at start.

Shapes are (K, N) per rank, read off the runtime's own module built on the meta device for each
rank (fused qkv, o, gate_up, down and a quantized lm_head, after the tensor-parallel split). Each
shape's record comes, in this order of preference, from a measurement on the build GPU
(`target.tune_kernels`), from the table measured on an H100 that ships with the kernels
(DEFAULT_W4A16_TABLE), or from the heuristic.
"""

from __future__ import annotations

import contextlib
import logging
import sys

import torch

from llmc.compiler.convert import meta_model
from llmc.kernels.w4a16_gemm import DEFAULT_W4A16_TABLE, DEFAULT_W4A16_TABLE_GPU, heuristic_w4a16_entries
from llmc.quant.formats import IntWeightFormat
from llmc.runtime.artifact import ModelConfig, ParallelPlan
from llmc.runtime.parallel.layout import all_rank_layouts

logger = logging.getLogger("llmc")

# SMs the heuristic's split-K plans for: the H200's (and the H100 SXM's), the GPUs the recorded
# table and the heuristic come from. A build with tune_kernels measures the real GPU instead.
PLAN_NUM_SMS = 132


def w4a16_gemm_shapes(model: ModelConfig, parallel: ParallelPlan, module_formats: dict[str, dict]) -> dict[tuple[int, int], int]:
    """(K, N) per rank of every w4a16 linear in the gpu layout → its group size (the first seen)."""
    shapes = {}
    for layout in all_rank_layouts(model, parallel):
        for module in meta_model(model, module_formats, layout).modules():
            fmt = getattr(module, "fmt", None)
            if isinstance(fmt, IntWeightFormat) and fmt.is_gpu_layout:
                shapes.setdefault((module.in_features, module.out_features), fmt.group_size)
    return shapes


def plan_w4a16_kernels(shapes: dict[tuple[int, int], int], measured: dict) -> dict:
    """The plan's w4a16_kernels (runtime/artifact.py:Plan): one record per shape, sorted by name.

    `measured`: {"KxN": record} from `tune_w4a16_shapes`, or empty."""
    records = {}
    for k, n in sorted(shapes):
        key = f"{k}x{n}"
        records[key] = measured.get(key) or _recorded_or_heuristic(k, n)
    return records


def _recorded_or_heuristic(k: int, n: int) -> dict:
    entries = DEFAULT_W4A16_TABLE.get(f"{k}x{n}")
    if entries:
        return _record("measured", DEFAULT_W4A16_TABLE_GPU, entries)
    return _record("heuristic", None, heuristic_w4a16_entries(k, n, PLAN_NUM_SMS))


def _record(source: str, gpu: str | None, entries) -> dict:
    rows = [[m, config if isinstance(config, dict) else config.to_dict(), us] for m, config, us in entries]
    return {"source": source, "gpu": gpu, "entries": rows}


def tune_w4a16_shapes(shapes: dict[tuple[int, int], int], dtype: torch.dtype) -> dict:
    """Measure every shape on this machine's GPU (w4a16_tune), one group size at a time.

    float32 artifacts are tuned in bfloat16: on CUDA their fused tiles run as dequantize + matmul."""
    from llmc.kernels.w4a16_tune import tune_w4a16

    tune_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    gpu = torch.cuda.get_device_name()
    measured = {}
    for group_size in sorted(set(shapes.values())):
        group_shapes = [shape for shape, g in shapes.items() if g == group_size]
        logger.info("tuning W4A16 kernels on %s: %d shape(s), group_size %d", gpu, len(group_shapes), group_size)
        with contextlib.redirect_stdout(sys.stderr):  # the tuner's notes are logs, not results
            table = tune_w4a16(group_shapes, dtype=tune_dtype, group_size=group_size)
        measured |= {key: _record("measured", gpu, entries) for key, entries in table.items()}
    return measured
