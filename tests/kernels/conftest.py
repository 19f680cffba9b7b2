"""Kernel tests: Triton kernels against torch / float64 oracles.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set here before any
kernel module is imported: triton reads it when a kernel is decorated). The cases on "cuda" are
marked gpu (deselected by default; run them with -m gpu on a GPU machine, at full speed).

Known interpreter limits (triton 3.9), none of which the GPU shares: tl.dot misreads bfloat16
operands (it multiplies their raw bits), so kernels built on tl.dot are checked in fp16 and fp32 on
the CPU and in bf16 and fp16 on the GPU; float32 → bfloat16 casts truncate instead of rounding; the
float8_e4m3 cast halves a value that rounds up into the next binade. The tests allow for the last
two on the CPU only.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

_GPU = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]


def _cases(cpu_dtypes, gpu_dtypes):
    cases = [pytest.param(("cpu", d), id=f"cpu-{str(d)[6:]}") for d in cpu_dtypes]
    return cases + [pytest.param(("cuda", d), id=f"cuda-{str(d)[6:]}", marks=_GPU) for d in gpu_dtypes]


@pytest.fixture(params=_cases([torch.float16, torch.float32], [torch.bfloat16, torch.float16]))
def dot_case(request) -> tuple[str, torch.dtype]:
    """(device, dtype) for kernels that use tl.dot."""
    return request.param


@pytest.fixture(params=_cases([torch.bfloat16, torch.float16, torch.float32], [torch.bfloat16, torch.float16]))
def elementwise_case(request) -> tuple[str, torch.dtype]:
    """(device, dtype) for elementwise / reduction kernels."""
    return request.param


@pytest.fixture(params=[pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=_GPU)])
def device(request) -> str:
    return request.param


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm().clamp(min=1e-30))


@pytest.fixture
def rel_err():
    """relative_error(actual, expected) = ||actual - expected|| / ||expected||, in float64."""
    return relative_error


def sm90_compile_facts(script: str) -> dict:
    """Run `script` (it compiles kernels for sm_90 with the installed triton and its ptxas, and prints a JSON
    object of facts about each as its last line; "SKIP ..." where triton has no ptxas) in a process of its own,
    without the interpreter the tests here run; the facts, or the test skipped."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    if done.stdout.startswith("SKIP"):
        pytest.skip(done.stdout)
    return json.loads(done.stdout.splitlines()[-1])
