"""kernels/launch_triton: a launch class must never join two calls that Triton compiles differently.

The reference is Triton's own specializer (`native_specialize_impl`, what JITFunction.run calls for every
argument): any two values that `_arg_class` puts in one class must get the same specialization from
Triton. The GPU case checks the reused kernels' results against torch.
"""

import itertools

import pytest
import torch

triton = pytest.importorskip("triton")
launch_triton = pytest.importorskip("llmc.kernels.launch_triton")


def _samples():
    base = torch.zeros(256, dtype=torch.float32)
    half = torch.zeros(256, dtype=torch.bfloat16)
    values = [base, base[1:], base[4:], base[2:], half, half[8:], half[1:], torch.zeros(4, dtype=torch.int32),
              torch.zeros(4, dtype=torch.int64)]
    values += [0, 1, 2, 15, 16, 17, 32, 48, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, 2**40, 2**63 - 1, 2**63,
               -(2**31), -(2**31) - 16, 0.0, 1.0, 1.5, True, False, None]
    try:
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    except ImportError:
        return values
    x = torch.zeros(64, 128, dtype=torch.bfloat16)
    w = torch.zeros(32, 256, dtype=torch.int32)
    for tensor, block in ((x, [16, 64]), (x, [64, 64]), (w, [16, 128]), (x[:, 64:], [16, 64])):
        for rows in (tensor.shape[0], tensor.shape[0] - 3):
            dtype = gl.bfloat16 if tensor.dtype == torch.bfloat16 else gl.int32
            layout = gl.NVMMASharedLayout.get_default_for(block, dtype)
            values.append(TensorDescriptor(tensor, [rows, tensor.shape[1]], list(tensor.stride()), block, layout))
    return values


def test_one_launch_class_is_one_triton_specialization():
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    samples = _samples()
    classes = [launch_triton._arg_class(v) for v in samples]
    assert all(c is not None for c in classes)
    specs = [native_specialize_impl(BaseBackend, v, False, True, True) for v in samples]
    joined = 0
    for (a, ca, sa), (b, cb, sb) in itertools.combinations(zip(samples, classes, specs), 2):
        if ca == cb:
            joined += 1
            assert sa == sb, (a if not isinstance(a, torch.Tensor) else (a.dtype, a.data_ptr() % 16), sa, sb)
    assert joined >= 10  # the classes do join calls (else reuse would never happen)
    # Triton tells these apart, and so must the classes
    assert len({c for c, s in zip(classes, specs)}) >= len({str(s) for s in specs})


def _jit_function():
    from triton.runtime.jit import JITFunction

    def kernel(x_ptr, n, scale, BLOCK: "tl.constexpr" = 64):  # noqa: F821 (a string annotation, never evaluated)
        pass

    return JITFunction(kernel)


def test_launch_class_keys_constexprs_and_options_by_value_and_type():
    relauncher = launch_triton.Relauncher(_jit_function())
    x = torch.zeros(64)
    key = relauncher.launch_class((x, 64, 0.5), {"BLOCK": 64, "num_warps": 4}, 0)
    assert key == relauncher.launch_class((x, 128, 2.0), {"BLOCK": 64, "num_warps": 4}, 0)  # same classes
    assert key != relauncher.launch_class((x, 64, 0.5), {"BLOCK": 128, "num_warps": 4}, 0)  # a constexpr's value
    assert key != relauncher.launch_class((x, 64, 0.5), {"BLOCK": 64.0, "num_warps": 4}, 0)  # its type (64 == 64.0)
    assert key != relauncher.launch_class((x, 64, 0.5), {"BLOCK": 64, "num_warps": 8}, 0)  # a launch option
    assert key != relauncher.launch_class((x, 64, 0.5), {"BLOCK": 64, "num_warps": 4}, 1)  # the device
    assert key != relauncher.launch_class((x, 65, 0.5), {"BLOCK": 64, "num_warps": 4}, 0)  # n's divisibility
    assert key != relauncher.launch_class((x[1:], 64, 0.5), {"BLOCK": 64, "num_warps": 4}, 0)  # alignment
    assert key != relauncher.launch_class((x, 64, 0.5), {"num_warps": 4}, 0)  # BLOCK left to its default
    assert relauncher.launch_class((x, 64, 0.5), {"BLOCK": [64]}, 0) is None  # unhashable: Triton's path
    assert relauncher.launch_class((x, 64, object()), {}, 0) is None  # an unknown type: Triton's path


def test_relaunch_returns_interpreted_kernels_as_they_are():
    class NotJit:
        pass

    kernel = NotJit()
    assert launch_triton.relaunch(kernel) is kernel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_reused_kernels_compute_what_triton_launches_compute():
    from llmc.kernels.norm_triton import _rms_norm_kernel, rms_norm

    relauncher = launch_triton.relaunch(_rms_norm_kernel)
    torch.manual_seed(0)
    weight = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    for rows, offset in [(3, 0), (5, 0), (16, 0), (3, 1), (7, 1), (1, 0), (33, 0), (3, 0)]:
        storage = torch.randn(rows * 4096 + offset, device="cuda", dtype=torch.bfloat16)
        x = storage[offset:].view(rows, 4096)  # offset 1: a pointer that is not 16-byte aligned
        out, _ = rms_norm(x, weight, 1e-5)
        xf = x.double()
        expected = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(torch.bfloat16).double() * weight.double()
        torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=2e-2)
    assert relauncher.kernels  # later calls of a class went through the kept kernel
