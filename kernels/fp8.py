"""W8A8 FP8 linear: per-token dynamic activation quantization feeding torch._scaled_mm (rowwise scales).

Shapes: x [..., K] in the model dtype; weight [N, K] float8_e4m3fn; weight_scale [N, 1] or [1, 1]
float32. Convention as llmc.quant.numerics (value ≈ fp8 * scale, scale = absmax / 448, floored at
MIN_SCALE), which the kernel tests check against.

`quantize_fp8_per_token` is one Triton kernel on CUDA (fp8_triton.py) instead of torch's five
(abs, amax, div, clamp, cast); plain torch elsewhere. Where the activations come from an RMSNorm or
SiLU · mul, those kernels quantize their own output (`Fp8Activation`) and this one does not run.
The product is either torch._scaled_mm (cuBLAS) or the Triton kernel with the operands swapped (fp8_triton.fp8_linear_small_m), with its tiles:
`select_fp8_kernel` reads which from DEFAULT_FP8_TABLE for the Llama-3-8B shapes it was measured on
(benchmarks/fp8_dispatch_sweep.py, one H100; neither path is fastest at every M), and for other
shapes uses the Triton kernel up to 16 tokens (64 where N <= 4096) and cuBLAS above.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Mapping, NamedTuple

import torch
from torch import Tensor

from . import can_use_triton, device_capability, is_triton_installed

FP8_E4M3_MAX = 448.0
MIN_SCALE = torch.finfo(torch.float32).tiny * 2**10  # an all-zero row would otherwise divide by zero
ONE_PASS_MAX = 16384  # the longest row a Triton kernel quantizes from registers (32 fp32 per thread at 16 warps)


class Fp8Activation(NamedTuple):
    """Activations already quantized per token, as `quantize_fp8_per_token` quantizes them: what a
    kernel that ends in the quantization (norm.rms_norm_fp8, activation.act_and_mul_fp8) hands a
    w8a8-fp8 linear in place of the tensor it would quantize itself."""

    values: Tensor  # float8_e4m3fn [..., K]
    scale: Tensor  # float32 [..., 1]
    dtype: torch.dtype  # of the values before quantization: the product's output dtype


def quantize_fp8_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., K] → (fp8 [..., K], scale [..., 1] float32), scale = max(absmax / 448, MIN_SCALE)."""
    if can_use_triton(x):
        from . import fp8_triton  # triton loads on the first CUDA call only

        return fp8_triton.quantize_fp8_per_token(x, MIN_SCALE)
    scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_E4M3_MAX).clamp(min=MIN_SCALE)
    return cast_to_fp8(x, scale), scale


def cast_to_fp8(x: Tensor, scale: Tensor) -> Tensor:
    """x / scale saturated to ±448 and rounded to E4M3 (the cast alone would give NaN out of range)."""
    return (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def has_fp8_tensor_cores(x: Tensor) -> bool:
    """FP8 matmuls need CUDA capability 8.9+ (Ada, Hopper)."""
    return x.is_cuda and device_capability(x.device) >= (8, 9)


def can_use_scaled_mm(x: Tensor, weight: Tensor) -> bool:
    """torch._scaled_mm needs FP8 tensor cores and both weight dims multiples of 16."""
    return has_fp8_tensor_cores(x) and all(d % 16 == 0 for d in weight.shape)


def _tiles(block_m: int, block_n: int, block_k: int, split_k: int, num_warps: int, num_stages: int) -> dict:
    return dict(block_m=block_m, block_n=block_n, block_k=block_k, split_k=split_k, num_warps=num_warps,
                num_stages=num_stages)


SCALED_MM = "scaled_mm"
DEFAULT_FP8_TABLE_GPU = "NVIDIA H100 80GB HBM3"  # where DEFAULT_FP8_TABLE was measured
# `python benchmarks/fp8_dispatch_sweep.py` on that GPU (torch 2.11, triton 3.6, bf16 activations;
# benchmarks/results/session10/fp8_dispatch_sweep-call4.json). {"KxN": ((max_m, kernel), ...)}: the
# first entry whose max_m >= M applies; kernel SCALED_MM or the Triton tiles. Beyond the last max_m
# (more tokens than were measured) cuBLAS runs.
DEFAULT_FP8_TABLE: Mapping[str, tuple] = MappingProxyType({
    "4096x6144": (
        (24, _tiles(16, 64, 256, 1, 4, 4)),
        (48, _tiles(32, 64, 256, 1, 4, 4)),
        (64, _tiles(64, 64, 256, 1, 8, 4)),
        (128, _tiles(64, 128, 256, 1, 8, 4)),
        (192, _tiles(128, 128, 128, 1, 8, 4)),
        (256, SCALED_MM),
        (384, _tiles(128, 64, 128, 1, 4, 3)),
        (512, _tiles(128, 128, 128, 1, 4, 3)),
        (4096, SCALED_MM),
    ),
    "4096x4096": (
        (32, _tiles(16, 64, 256, 1, 4, 4)),
        (64, _tiles(32, 64, 256, 1, 4, 4)),
        (128, _tiles(64, 64, 256, 1, 4, 4)),
        (256, _tiles(128, 64, 256, 1, 4, 4)),
        (4096, SCALED_MM),
    ),
    "4096x28672": (
        (24, _tiles(16, 128, 128, 1, 8, 3)),
        (32, _tiles(32, 64, 128, 1, 8, 3)),
        (48, SCALED_MM),
        (64, _tiles(64, 128, 128, 1, 8, 3)),
        (96, SCALED_MM),
        (128, _tiles(128, 128, 128, 1, 8, 3)),
        (4096, SCALED_MM),
    ),
    "14336x4096": (
        (32, _tiles(16, 64, 256, 2, 4, 4)),
        (64, _tiles(32, 64, 256, 2, 4, 4)),
        (96, _tiles(64, 64, 256, 1, 4, 4)),
        (128, _tiles(128, 64, 256, 2, 4, 4)),
        (256, _tiles(128, 64, 256, 1, 4, 4)),
        (512, SCALED_MM),
        (4096, _tiles(128, 128, 128, 1, 4, 3)),
    ),
})


def select_fp8_kernel(num_tokens: int, in_features: int, out_features: int) -> str | dict:
    """SCALED_MM, or the tiles of the Triton kernel (fp8_triton.fp8_linear_small_m's keywords)."""
    entries = DEFAULT_FP8_TABLE.get(f"{in_features}x{out_features}")
    if entries is not None:
        return next((kernel for max_m, kernel in entries if num_tokens <= max_m), SCALED_MM)
    # Other shapes: the few-token rule and tiles of the first H100 sweep (benchmarks/kernel_sweep.py)
    if num_tokens > 16 and (num_tokens > 64 or out_features > 4096):
        return SCALED_MM
    block_n = 128 if out_features >= 16384 else 64
    return _tiles(16, block_n, 256, 2 if in_features >= 8192 else 1, 4, 3 if block_n == 128 else 4)


def fp8_linear(x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None) -> Tensor:
    """y [..., N] in x's dtype = (x_fp8 * x_scale) @ (weight * weight_scale).T + bias, fp32 accumulation."""
    x_fp8, x_scale = quantize_fp8_per_token(x)  # [..., K], [..., 1]
    return fp8_matmul(x_fp8, x_scale, weight, weight_scale, bias, x.dtype)


def fp8_matmul(x_fp8: Tensor, x_scale: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None,
               out_dtype: torch.dtype, dense: Tensor | None = None) -> Tensor:
    """y [..., N] in out_dtype = (x_fp8 * x_scale) @ (weight * weight_scale).T + bias for activations
    already in FP8: x_scale [..., 1] per token, or one scale ([1] / [1, 1], a static input scale).
    torch._scaled_mm or the Triton kernel as `select_fp8_kernel` says, float32 math without FP8
    tensor cores (`dense`, where given: weight · weight_scale computed once)."""
    x2 = x_fp8.reshape(-1, x_fp8.shape[-1])  # [num_tokens, K]
    scale_a = x_scale.float().reshape(-1, 1)
    if scale_a.shape[0] != x2.shape[0]:
        scale_a = scale_a.expand(x2.shape[0], 1).contiguous()
    out_features = weight.shape[0]
    if not can_use_scaled_mm(x_fp8, weight):
        w = dense if dense is not None else weight.float() * weight_scale.float()  # [N, K]
        y = (x2.float() * scale_a) @ w.T
        y = y + bias.float() if bias is not None else y
        return y.to(out_dtype).reshape(*x_fp8.shape[:-1], out_features)
    kernel = select_fp8_kernel(x2.shape[0], x2.shape[1], out_features)
    if kernel != SCALED_MM and is_triton_installed():
        from .fp8_triton import fp8_linear_small_m

        y = fp8_linear_small_m(x2.contiguous(), scale_a, weight, weight_scale.float(), bias, out_dtype, **kernel)
        return y.reshape(*x_fp8.shape[:-1], out_features)
    scale_b = weight_scale.float().reshape(1, -1)  # [1, N] or [1, 1]
    if scale_b.shape[1] != out_features:
        scale_b = scale_b.expand(1, out_features).contiguous()
    y = torch._scaled_mm(x2, weight.t(), scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)
    return y.reshape(*x_fp8.shape[:-1], out_features)


# w8a8-fp8-block: weights with one scale per (row, group_size columns), from 128 x 128 blocks; activations
# quantized per token and group_size columns (DeepSeek-V3's, Qwen3's and llm-compressor's FP8_BLOCK scheme).

def expand_group_scales(scale: Tensor, group_size: int, size: int) -> Tensor:
    """scale [..., G] → [..., size]: each column's scale (column i takes group i // group_size)."""
    return scale.repeat_interleave(group_size, dim=-1)[..., :size]


def quantize_fp8_per_token_group(x: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """x [..., K] → (fp8 [..., K], scale [..., ceil(K / group_size)] float32): scale = max(absmax / 448,
    MIN_SCALE) of each token's group of group_size columns (a last partial group has its own). On CUDA one
    Triton kernel, whose scales come with strides (1, tokens) for a 2-D x (what cuBLAS's block-scaled GEMM reads)."""
    size = x.shape[-1]
    groups = -(-size // group_size)
    if can_use_triton(x):
        from . import fp8_triton

        values, scale = fp8_triton.quantize_fp8_per_token_group(x.reshape(-1, size), group_size, MIN_SCALE,
                                                                pdl=BLOCK_QUANT_PDL)
        return values.reshape(x.shape), scale if x.dim() == 2 else scale.reshape(*x.shape[:-1], groups)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group_size - size))
    absmax = padded.reshape(*x.shape[:-1], groups, group_size).abs().amax(dim=-1)
    scale = (absmax / FP8_E4M3_MAX).clamp(min=MIN_SCALE)  # [..., G]
    return cast_to_fp8(x, expand_group_scales(scale, group_size, size)), scale


def fp8_block_linear(x: Tensor, weight: Tensor, weight_scale: Tensor, group_size: int, bias: Tensor | None,
                     weight_scale_rows: Tensor | None = None, weight_scale_blocks: Tensor | None = None,
                     dense: Tensor | None = None) -> Tensor:
    """y [..., N] in x's dtype = (x quantized per token and group_size columns) @ (weight · weight_scale).T + bias,
    weight_scale [N, G] per row. On FP8 tensor cores with bf16/fp16 activations, above BLOCK_CUBLAS_MIN_TOKENS
    tokens, where the weight's scales come laid out for it (Fp8BlockFormat.derived_params): cuBLAS's block-scaled
    GEMM (`block_scaled_mm`), which takes a multiple of 4 tokens (session 43, probe_odd_m.py): the quantization
    pads to one with zero rows. Otherwise `fp8_block_matmul`."""
    size, out_features = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, size)
    tokens = x2.shape[0]
    if (tokens > BLOCK_CUBLAS_MIN_TOKENS and (weight_scale_rows is not None or weight_scale_blocks is not None)
            and x.dtype in (torch.bfloat16, torch.float16) and has_fp8_tensor_cores(x) and is_triton_installed()):
        from . import fp8_triton

        x_fp8, x_scale = fp8_triton.quantize_fp8_per_token_group(x2, group_size, MIN_SCALE, rows=-(-tokens // 4) * 4,
                                                                 pdl=BLOCK_QUANT_PDL)
        y = block_scaled_mm(x_fp8, x_scale, weight, weight_scale_rows, weight_scale_blocks, x.dtype)
        y = y[:tokens] + bias if bias is not None else y[:tokens]
        return y.reshape(*x.shape[:-1], out_features)
    x_fp8, x_scale = quantize_fp8_per_token_group(x2, group_size)
    y = fp8_block_matmul(x_fp8, x_scale, weight, weight_scale, group_size, bias, x.dtype, dense)
    return y.reshape(*x.shape[:-1], out_features)


BLOCK_QUANT_PDL: bool | None = None  # the group quantization's launch: None as every kernel's (kernels.use_pdl)
BLOCK_CUBLAS_MIN_TOKENS = 16  # above: cuBLAS's block-scaled GEMM (benchmarks/RESULTS.md, session 43)
BLOCK_ROW_SCALES_MAX_TOKENS = 64  # up to: its per-row weight scales, faster there than 128 x 128 (but on gate_up)
BLOCK_ROW_SCALES_MAX_OUT = 16384  # outputs from which 128 x 128 scales are faster at every token count (gate_up)


def block_scaled_mm(x_fp8: Tensor, x_scale: Tensor, weight: Tensor, weight_scale_rows: Tensor | None,
                    weight_scale_blocks: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    """cuBLAS's block-scaled FP8 GEMM: x_fp8 [M, K] (M a multiple of 4) with its 1 x 128 scales x_scale [M, K / 128]
    (strides (1, M)), and the weight's scales either per row and 128 columns (weight_scale_rows [N, K / 128], strides
    (1, N)) or per 128 x 128 block (weight_scale_blocks [N / 128, K / 128]). Rows up to BLOCK_ROW_SCALES_MAX_TOKENS
    tokens (1.1-1.6x faster there on qkv, o and down, session 43), blocks beyond; whichever the weight has."""
    import torch.nn.functional as F

    if weight_scale_rows is not None and (weight_scale_blocks is None or x_fp8.shape[0] <= BLOCK_ROW_SCALES_MAX_TOKENS):
        st = F.ScalingType
        return F.scaled_mm(x_fp8, weight.t(), x_scale, st.BlockWise1x128, weight_scale_rows, st.BlockWise1x128,
                           output_dtype=out_dtype)
    return torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=weight_scale_blocks.t(), out_dtype=out_dtype)


def fp8_block_matmul(x_fp8: Tensor, x_scale: Tensor, weight: Tensor, weight_scale: Tensor, group_size: int,
                     bias: Tensor | None, out_dtype: torch.dtype, dense: Tensor | None = None) -> Tensor:
    """y [M, N] in out_dtype = (x_fp8 · x_scale) @ (weight · weight_scale).T + bias, the scales per group_size
    columns: x_scale [M, G], weight_scale [N, G]. The Triton kernel on FP8 tensor cores (each K chunk's product
    scaled into a float32 accumulator), float32 math elsewhere (`dense`, where given: the weight so dequantized
    once)."""
    size = x_fp8.shape[-1]
    if not (has_fp8_tensor_cores(x_fp8) and is_triton_installed()):
        a = x_fp8.float() * expand_group_scales(x_scale.float(), group_size, size)
        if dense is None:
            dense = weight.float() * expand_group_scales(weight_scale.float(), group_size, size)
        y = a @ dense.T
        return (y + bias.float() if bias is not None else y).to(out_dtype)
    from .fp8_triton import fp8_linear_small_m

    kernel = select_fp8_block_kernel(x_fp8.shape[0], size, weight.shape[0])
    return fp8_linear_small_m(x_fp8.contiguous(), x_scale, weight, weight_scale, bias, out_dtype,
                              group_size=group_size, **kernel)


def compact_row_scales(weight_scale: Tensor, rows: int) -> Tensor | None:
    """Per-row scales [N, G] → one row per block of `rows` rows from row 0, [ceil(N / rows), G] float32; None if the
    rows of some block do not hold one scale (no block layout can store them)."""
    compact = weight_scale[::rows].float().contiguous()
    return compact if torch.equal(compact.repeat_interleave(rows, dim=0)[: weight_scale.shape[0]],
                                  weight_scale.float()) else None


def block_scales(weight_scale: Tensor, group_size: int) -> Tensor | None:
    """weight_scale [N, G] (per row) → [N / 128, G], one row per 128-row block, for cuBLAS's 128 x 128 weight scales;
    None where it cannot take them: group_size not 128, N not a multiple of 128, G not a multiple of 4 (it gave
    wrong products at K = 256 and 384, session 43's probe_small.py), or rows of a 128-row block that do not share
    their scales (an import's or a build's blocks of another height)."""
    rows, groups = weight_scale.shape
    if group_size != 128 or rows % 128 or groups % 4:  # (cuBLAS reads the groups as a leading dimension: a multiple of 4)
        return None
    return compact_row_scales(weight_scale, 128)


def select_fp8_block_kernel(num_tokens: int, in_features: int, out_features: int) -> dict:
    """The Triton kernel's tiles for w8a8-fp8-block (block_k is cut to the group in the kernel): for up to 16 tokens
    the best of session 43's sweep on Llama-3-8B's shapes (split K 4 for 4096 outputs, narrow tiles for a long K),
    then 64- and 128-token tiles (where cuBLAS cannot run)."""
    if num_tokens <= 16:
        narrow = out_features <= 4096 and in_features >= 8192
        return _tiles(16, 32 if narrow else 64, 128, 4 if out_features <= 4096 else 2, 4, 3 if out_features >= 16384 else 4)
    block_m = 64 if num_tokens <= 64 else 128
    return _tiles(block_m, 64, 128, 2 if block_m == 64 else 1, 4, 3)
