"""The block build's one-chunk garbage on a tiny model (call 5, diag_block_gpu.py: float32, 53 tokens): cuBLAS's
block-scaled GEMM at tiny shapes (K 256 / 384, N 256 / 512 / 768, 56 tokens), float32 and bf16 outputs, per-row and
128 x 128 weight scales, against the float64 product."""
import torch
import torch.nn.functional as F

from llmc.kernels.fp8 import block_scales, expand_group_scales, quantize_fp8_per_token_group
from llmc.quant.fp8 import quantize_fp8_weight_block

st = F.ScalingType
for k, n in ((256, 512), (256, 256), (256, 768), (384, 256), (4096, 4096)):
    q = quantize_fp8_weight_block(torch.randn(n, k, device="cuda") * 0.05, (128, 128))
    rows = q.scales.t().contiguous().t()
    blocks = block_scales(q.scales, 128)
    w64 = q.qweight.double() * expand_group_scales(q.scales.double(), 128, k)
    for m in (56, 64, 256):
        x = torch.randn(m, k, device="cuda")
        xq, xs = quantize_fp8_per_token_group(x, 128)
        exact = (xq.double() * expand_group_scales(xs.double(), 128, k)) @ w64.T
        for dtype in (torch.float32, torch.bfloat16):
            out = []
            for label, fn in (("rows", lambda: F.scaled_mm(xq, q.qweight.t(), xs, st.BlockWise1x128, rows, st.BlockWise1x128, output_dtype=dtype)),
                              ("blocks", lambda: torch._scaled_mm(xq, q.qweight.t(), scale_a=xs, scale_b=blocks.t(), out_dtype=dtype))):
                try:
                    y = fn()
                    out.append(f"{label} {float((y.double() - exact).norm() / exact.norm()):.2e}")
                except Exception as e:  # noqa: BLE001
                    out.append(f"{label} {type(e).__name__}: {str(e).splitlines()[0][:90]}")
            print(f"K={k} N={n} M={m} {str(dtype)[6:]}: " + "; ".join(out), flush=True)
