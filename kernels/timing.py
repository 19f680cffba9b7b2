"""GPU timing for the tuner and the benchmarks: CUDA events, warm-up, cold L2, median."""

from __future__ import annotations

import statistics
from typing import Callable

import torch
from torch import Tensor

FLUSH_BYTES = 256 * 2**20  # larger than any L2 so far (H100 50 MB, H200 60 MB)


def make_l2_flush_buffer(device: torch.device | str = "cuda") -> Tensor:
    return torch.ones(FLUSH_BYTES // 4, dtype=torch.float32, device=device)


def median_time_ms(
    fn: Callable[[], object], flush: Tensor | None, num_warmup: int = 3, num_reps: int = 25,
    use_graph: bool = True,
) -> float:
    """Median device time of fn() in ms, each repetition with a cold L2 when `flush` is given.

    use_graph: fn is captured once in a CUDA graph and the replays are timed, as decode steps run
    in the engine: the host's Python and launch overhead stays out of the number (without a graph,
    a host slower than the flush leaves the GPU idle inside the timed region). fn must then be
    capturable (no host-to-device copies of pageable memory).

    The flush READS a buffer larger than L2 (a sum): writing one instead (zero_, as
    triton.testing.do_bench does) leaves L2 full of dirty lines whose write-back then lands inside
    the timed kernel (seen here: +10-15 µs on an H200, most of a 4096×4096 W4A16 GEMV). The flush
    also keeps the GPU busy while the host enqueues fn, so the events time the kernels, not
    Python's launch overhead.
    """
    for _ in range(num_warmup):
        fn()
    torch.cuda.synchronize()
    run = fn
    if use_graph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        run = graph.replay
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(num_reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(num_reps)]
    for start, end in zip(starts, ends):
        if flush is not None:
            flush.sum()
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in zip(starts, ends))
