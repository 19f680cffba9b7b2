"""Programmatic dependent launch in Triton kernels (imported only when a kernel runs).

A kernel launched with `launch_pdl=True` may start before the kernel ahead of it in the stream has
finished (kernels/__init__.use_pdl). `wait_for_inputs` is where it stops until that kernel is
complete and its writes are visible (`griddepcontrol.wait`, which returns at once in a kernel
launched without PDL); after it the kernel lets the next one launch (`launch_dependents`), which
will itself wait. Nothing before the wait may read what an earlier kernel writes or write what one
reads: only weights and other tensors no kernel of the step changes.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from . import use_pdl


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl_args(device) -> dict:
    """The launch keywords of a kernel that calls `wait_for_inputs(PDL)` first."""
    enabled = use_pdl(device)
    return {"PDL": enabled, "launch_pdl": enabled}
