"""pytest plugin (-p probe_plugin), session 46 call 7: which part of gpt-oss's CUDA run is off. PROBE=attn runs the
attention's torch path on CUDA, PROBE=moe the MoE's torch reference (both torch code, right on the CPU)."""
import os


def pytest_configure(config):
    what = os.environ.get("PROBE", "")
    if "all" in what:  # every kernel module's Triton check: the torch paths everywhere
        import importlib

        for name in ("activation", "attention", "fp8", "fused_moe", "int8", "mla_attention", "norm", "sampling",
                     "w4a16_gemm"):
            importlib.import_module(f"llmc.kernels.{name}").can_use_triton = lambda *args, **kwargs: False
    if "attn" in what:
        import llmc.kernels.attention as attention

        attention.can_use_triton = lambda *args, **kwargs: False
    if "moe" in what:
        import llmc.runtime.models.moe as moe
        from llmc.kernels.fused_moe import fused_moe_reference

        moe.fused_moe_experts = lambda x, w, ids, gu, dn, config=None, swiglu=None: fused_moe_reference(
            x, w, ids, gu, dn, swiglu=swiglu)
