"""Kernels: Triton kernels and a plain-torch fallback for each (a leaf package: imports nothing of llmc).

Each public module (`attention`, `norm`, `rotary`, `activation`, `fp8`, `w4a16_gemm`) holds the
torch fallback and the dispatch; the `@triton.jit` code lives in the `*_triton` modules, imported
only when a kernel is about to run on CUDA. That keeps triton out of CPU-only imports, and lets the
kernel tests set TRITON_INTERPRET before any kernel is decorated (triton reads it at decoration).
"""

from __future__ import annotations

import functools
import importlib.util

from torch import Tensor


@functools.cache
def is_triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def can_use_triton(*tensors: Tensor) -> bool:
    """The dispatch rule of every public kernel: Triton when all tensors are on CUDA and triton imports."""
    return all(t.is_cuda for t in tensors) and is_triton_installed()
