"""Launching a compiled Triton or Gluon kernel again without Triton's per-call dispatch.

`kernel[grid](*args, **kwargs)` costs 45-250 µs of host time on the GPU machine (benchmarks/launch_cost.py,
RESULTS.md session 31): before each launch Triton binds the arguments, specializes every one of them
(dtype and 16-byte alignment of pointers, int32/int64 and divisibility by 16 of integers, the type
string of a TMA descriptor), hashes that into its cache key and checks the globals the kernel read.
A decode step replays CUDA graphs and never pays it; an eager step (a prefill, a mixed step) pays it
for every kernel of every layer, and a short request's time to first token was 3-13x its kernel time.

`relaunch(kernel)[grid](*args, **kwargs)` launches the same way, and keeps the compiled kernel that the
first launch of each argument class returned. Later calls of the same class call its launcher
directly. The class (`launch_class`) is a refinement of Triton's specialization: every property that
Triton specializes on is in it, plus the values of constexprs and launch options, the device, and the
divisibility of descriptor shapes and strides. Two calls of one class therefore compile to the same
kernel (tests/kernels/test_launch.py checks this against Triton's own specializer). Arguments of any
other type, and grids given as functions, take Triton's path every time. Under TRITON_INTERPRET (the
CPU tests) `relaunch` returns the kernel itself.
"""

from __future__ import annotations

import torch
from triton import knobs
from triton.runtime import driver
from triton.runtime.jit import JITFunction

_INT32 = (-(2**31), 2**31)
_INT64_MAX = 2**63


def _int_class(value: int) -> tuple:
    return (value == 1, value % 16 == 0, _INT32[0] <= value < _INT32[1], value >= _INT64_MAX)


def _arg_class(value):
    """What Triton's specialization of a non-constexpr argument depends on (and a little more); None
    for a type this module does not know (the call then takes Triton's path)."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return ("u1",)
    if isinstance(value, int):
        return _int_class(value)
    if isinstance(value, float):
        return ("fp32",)
    if value is None:
        return ("none",)
    base, block_shape = getattr(value, "base", None), getattr(value, "block_shape", None)
    if isinstance(base, torch.Tensor) and block_shape is not None:  # a host TMA descriptor (triton or gluon)
        return (type(value), base.dtype, base.data_ptr() % 16 == 0, tuple(block_shape),
                getattr(value, "layout", None), getattr(value, "padding", None),
                tuple(_int_class(v) for v in value.shape), tuple(_int_class(v) for v in value.strides))
    return None


class Relauncher:
    """A JIT kernel's launches, the compiled kernel reused per argument class (module docstring)."""

    def __init__(self, fn: JITFunction):
        self.fn = fn
        params = list(fn.signature.parameters.values())
        self.names = [p.name for p in params]
        self.positions = {name: i for i, name in enumerate(self.names)}
        self.defaults = [p.default for p in params]
        self.is_constexpr = [p.is_constexpr for p in fn.params]
        self.kernels: dict = {}

    def launch_class(self, args: tuple, kwargs: dict, device: int) -> tuple | None:
        """The class of a call's arguments on `device` (an index), hashable; None where a value is of an
        unknown type."""
        if len(args) > len(self.names):
            return None
        key = [device, len(args)]
        for i, value in enumerate(args):
            part = (type(value), value) if self.is_constexpr[i] else _arg_class(value)
            if part is None:
                return None
            key.append(part)
        for name in sorted(kwargs):
            value, i = kwargs[name], self.positions.get(name)
            is_value = i is None or self.is_constexpr[i]  # i None: a launch option (num_warps, launch_pdl)
            part = (type(value), value) if is_value else _arg_class(value)
            if part is None:
                return None
            key.append((name, part))
        key = tuple(key)
        try:
            hash(key)
        except TypeError:  # an unhashable constexpr or option
            return None
        return key

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def run(self, grid, args: tuple, kwargs: dict):
        device = driver.active.get_current_device()
        key = None if callable(grid) else self.launch_class(args, kwargs, device)
        kernel = self.kernels.get(key) if key is not None else None
        if kernel is None:
            kernel = self.fn[grid](*args, **kwargs)
            if key is not None and hasattr(kernel, "packed_metadata"):
                self.kernels[key] = kernel
            return kernel
        values = list(args)
        for i in range(len(args), len(self.names)):
            name = self.names[i]
            values.append(kwargs[name] if name in kwargs else self.defaults[i])
        stream = driver.active.get_current_stream(device)
        grid_1 = grid[1] if len(grid) > 1 else 1
        grid_2 = grid[2] if len(grid) > 2 else 1
        kernel.run(grid[0], grid_1, grid_2, stream, kernel.function, kernel.packed_metadata,
                   kernel.launch_metadata(grid, stream, *values), knobs.runtime.launch_enter_hook,
                   knobs.runtime.launch_exit_hook, *values)
        return kernel


def relaunch(fn):
    """`fn`'s Relauncher (one per kernel), or fn itself where it is not a compiled JIT kernel (the
    interpreter)."""
    if not isinstance(fn, JITFunction):
        return fn
    relauncher = _RELAUNCHERS.get(fn)
    if relauncher is None:
        relauncher = _RELAUNCHERS[fn] = Relauncher(fn)
    return relauncher


_RELAUNCHERS: dict = {}
