"""Which token counts cuBLAS's block-scaled GEMM (torch._scaled_mm, 1 x 128 activation scales, 128 x 128 weight scales)
takes, with the activation scales' token stride exactly M or M rounded up to 4; errors printed in one line."""
import torch

from llmc.kernels.fp8 import block_scales, expand_group_scales, quantize_fp8_per_token_group
from llmc.quant.fp8 import quantize_fp8_weight_block

k, n = 4096, 6144
w = torch.randn(n, k, device="cuda") * 0.02
q = quantize_fp8_weight_block(w, (128, 128))
blocks = block_scales(q.scales, 128)
w64 = q.qweight.double() * expand_group_scales(q.scales.double(), 128, k)
for m in (1, 2, 3, 5, 8, 17, 18, 19, 20, 33, 37, 100, 255, 257, 1000, 4099):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xq, xs = quantize_fp8_per_token_group(x, 128)
    exact = (xq.double() * expand_group_scales(xs.double(), 128, k)) @ w64.T
    for label, pad in (("stride M", m), ("stride M rounded to 4", -(-m // 4) * 4)):
        buf = torch.empty(xs.shape[1], pad, device="cuda")
        buf[:, :m] = xs.t()
        sa = buf[:, :m].t()
        try:
            y = torch._scaled_mm(xq, q.qweight.t(), scale_a=sa, scale_b=blocks.t(), out_dtype=torch.bfloat16)
            err = float((y.double() - exact).norm() / exact.norm())
            print(f"M={m} {label} {tuple(sa.stride())}: ok, rel err {err:.2e}")
        except Exception as e:  # noqa: BLE001
            print(f"M={m} {label} {tuple(sa.stride())}: {type(e).__name__}: {str(e).splitlines()[0][:150]}")
