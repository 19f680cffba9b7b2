"""session 46: which part of gpt-oss's fused MoE is wrong on CUDA (call 5: fp16 off by 0.73, the interpreter right):
the Triton fused MoE against the torch reference, with the bias alone, the clamped SwiGLU alone, both, float32."""
import torch

from llmc.kernels import fused_moe_triton
from llmc.kernels.fused_moe import ExpertWeights, fused_moe_reference

g = torch.Generator().manual_seed(0)
E, H, I, T = 4, 64, 32, 9
x = torch.randn(T, H, generator=g)
w1, w2 = torch.randn(E, 2 * I, H, generator=g) * 0.2, torch.randn(E, H, I, generator=g) * 0.2
b1, b2 = torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)
ids = torch.randint(0, E, (T, 2), generator=g)
weights = torch.rand(T, 2, generator=g)
for dtype in (torch.float32, torch.float16):
    for bias in (False, True):
        for swiglu in (None, (1.702, 1.0)):
            up = ExpertWeights(w1, bias=b1 if bias else None)
            dn = ExpertWeights(w2, bias=b2 if bias else None)
            want = fused_moe_reference(x.double(), weights.double(), ids, ExpertWeights(w1.double(), bias=b1.double() if bias else None),
                                       ExpertWeights(w2.double(), bias=b2.double() if bias else None), swiglu=swiglu)
            on = lambda t: None if t is None else t.to("cuda", dtype)  # noqa: E731
            got = fused_moe_triton.fused_moe(on(x), weights.cuda(), ids.cuda(), ExpertWeights(on(w1), bias=on(up.bias)),
                                             ExpertWeights(on(w2), bias=on(dn.bias)), swiglu=swiglu)
            err = ((got.double().cpu() - want).norm() / want.norm()).item()
            print(f"{dtype} bias={bias} swiglu={swiglu is not None}: rel err {err:.2e}", flush=True)
