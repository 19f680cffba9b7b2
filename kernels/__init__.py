"""Kernels: Triton kernels and a plain-torch fallback for each (a leaf package: imports nothing of llmc).

Each public module (`attention`, `norm`, `activation`, `fp8`, `w4a16_gemm`) holds the torch
fallback and the dispatch (`rotary` only the torch rotation: on CUDA the rotary embedding runs
inside attention's KV-write kernel); the `@triton.jit` code lives in the `*_triton` modules, imported
only when a kernel is about to run on CUDA. That keeps triton out of CPU-only imports, and lets the
kernel tests set TRITON_INTERPRET before any kernel is decorated (triton reads it at decoration).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
from torch import Tensor


@functools.cache
def is_triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def can_use_triton(*tensors: Tensor) -> bool:
    """The dispatch rule of every public kernel: Triton when all tensors are on CUDA and triton imports."""
    return all(t.is_cuda for t in tensors) and is_triton_installed()


def device_num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device ("cuda" alone: the current one), asked once per
    device: kernels plan their grids from it at every call."""
    return _properties(device).multi_processor_count


def device_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA device, asked once per device (9.0: Hopper)."""
    props = _properties(device)
    return props.major, props.minor


def device_index(device: torch.device) -> int:
    """The index of a CUDA device ("cuda" alone: the current one)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def _properties(device: torch.device):
    return _properties_of(device_index(device))


@functools.cache
def _properties_of(index: int):
    return torch.cuda.get_device_properties(index)


def use_pdl(device: torch.device) -> bool:
    """Whether this device's kernels launch with programmatic dependent launch (PDL): a kernel may
    start while the one before it still runs, and waits (`griddepcontrol.wait`, kernels/pdl_triton.py)
    only before it reads what that one writes; a decode GEMV streams its first weight tiles in
    meanwhile. Hopper (sm_90) and later, not Triton's interpreter (CPU tensors); LLMC_PDL=0 turns it
    off (read once per device, when its first kernel launches)."""
    if device.type != "cuda":
        return False
    return _use_pdl_on(device_index(device))


@functools.cache
def _use_pdl_on(index: int) -> bool:
    return os.environ.get("LLMC_PDL", "1") != "0" and _properties_of(index).major >= 9


def to_device(host: Tensor, device: torch.device) -> Tensor:
    """`host` (a CPU tensor) copied to `device` without making the host wait: on CUDA through pinned
    memory, non-blocking. `torch.tensor(list, device="cuda")` and `.to("cuda")` from pageable memory
    synchronize the stream, so the host could not run ahead of the GPU (issue 12)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
