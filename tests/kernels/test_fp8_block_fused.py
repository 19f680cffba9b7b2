"""The RMSNorm and act · mul kernels that end in w8a8-fp8-block's activation quantization (per token and group of
columns, rows padded to cuBLAS's multiple of 4): bit for bit the unfused kernel followed by the group quantization's
kernel (fp8_triton.quantize_fp8_per_token_group), and their scales against the group absmax / 448 of torch's norm
and activation."""

import pytest
import torch

from llmc.kernels import activation, norm
from llmc.kernels.fp8 import MIN_SCALE, Fp8BlockActivation, cublas_rows, quantize_fp8_per_token_group
from tests.kernels.conftest import sm90_compile_facts

# the scales against torch's values: bf16/fp16 values may differ by a step of each of their two roundings (the norm's
# and its product with the weight; the interpreter truncates bf16)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3.2e-2}
# (tokens, width, group): two full groups, a partial last group, a row narrower than its group, smaller groups
CASES = [(1, 256, 128), (3, 200, 128), (5, 64, 128), (17, 200, 64), (3, 96, 16)]


def _assert_same(actual: tuple, expected: tuple) -> None:
    """Two (values, scale) pairs equal bit for bit, in the same layout (the scales' strides too)."""
    assert actual[0].dtype == expected[0].dtype == torch.float8_e4m3fn and actual[0].shape == expected[0].shape
    assert torch.equal(actual[0].cpu().view(torch.uint8), expected[0].cpu().view(torch.uint8))
    assert actual[1].shape == expected[1].shape and actual[1].stride() == expected[1].stride()
    assert torch.equal(actual[1].cpu(), expected[1].cpu())


def _check_scales(scale: torch.Tensor, reference: torch.Tensor, group: int, dtype: torch.dtype) -> None:
    """The tokens' scales against the group absmax / 448 of `reference` (torch's values, float64); the padding rows'
    at the floor."""
    tokens, width = reference.shape
    padded = torch.nn.functional.pad(reference.double(), (0, -width % group))
    expected = (padded.unflatten(-1, (-1, group)).abs().amax(-1) / 448).clamp(min=MIN_SCALE)
    torch.testing.assert_close(scale[:tokens].cpu().double(), expected, rtol=TOLERANCE[dtype], atol=0)
    assert bool((scale[tokens:] == MIN_SCALE).all())


@pytest.mark.parametrize("tokens,width,group", CASES)
def test_rms_norm_quantized_in_groups_in_its_kernel_equals_the_two_kernels(elementwise_case, tokens, width, group):
    """The norm's kernel with group-quantized FP8 output (for a w8a8-fp8-block qkv / gate_up), with and without the
    residual add: the values, scales (strides (1, rows)) and zero padding rows of the norm's kernel followed by the
    group quantization's kernel with the same rows, and the same residual."""
    from llmc.kernels.fp8_triton import quantize_fp8_per_token_group as quantize_groups_kernel
    from llmc.kernels.norm_triton import rms_norm, rms_norm_fp8_groups

    device, dtype = elementwise_case
    torch.manual_seed(tokens)
    x = (4 * torch.randn(tokens, width) * torch.linspace(0.1, 3, width)).to(dtype).to(device)
    residual = torch.randn(tokens, width).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(width)).to(dtype).to(device)
    if tokens > 1:
        x[1], residual[1] = 0.0, 0.0  # an all-zero row: every group at the scale's floor
    rows = cublas_rows(tokens)
    for res in (None, residual):
        values, scale, new_residual = rms_norm_fp8_groups(x, weight, 1e-6, res, MIN_SCALE, group, rows)
        normed, expected_residual = rms_norm(x, weight, 1e-6, res)
        _assert_same((values, scale), quantize_groups_kernel(normed, group, MIN_SCALE, rows=rows))
        assert scale.shape == (rows, -(-width // group)) and scale.stride() == (1, rows)
        assert (new_residual is None) == (res is None)
        if res is not None:
            assert torch.equal(new_residual, expected_residual)
        torch_normed = norm.rms_norm(x.cpu(), weight.cpu(), 1e-6) if res is None else \
            norm.add_rms_norm(x.cpu(), res.cpu(), weight.cpu(), 1e-6)[0]
        _check_scales(scale, torch_normed, group, dtype)
        assert not values[tokens:].cpu().view(torch.uint8).any()


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("tokens,width,group", CASES)
def test_act_and_mul_quantized_in_groups_in_its_kernel_equals_the_two_kernels(elementwise_case, tokens, width, group,
                                                                               act):
    """SiLU · mul and GELU(tanh) · mul with group-quantized FP8 output (for a w8a8-fp8-block down): the values and
    scales of the activation's kernel followed by the group quantization's kernel, an all-zero token at the floor."""
    from llmc.kernels.activation_triton import act_and_mul, act_and_mul_fp8_groups
    from llmc.kernels.fp8_triton import quantize_fp8_per_token_group as quantize_groups_kernel

    device, dtype = elementwise_case
    torch.manual_seed(tokens)
    gate_up = (3 * torch.randn(tokens, 2 * width)).to(dtype).to(device)
    gate_up[-1] = 0.0
    rows = cublas_rows(tokens)
    values, scale = act_and_mul_fp8_groups(gate_up, MIN_SCALE, act, group, rows)
    _assert_same((values, scale), quantize_groups_kernel(act_and_mul(gate_up, act), group, MIN_SCALE, rows=rows))
    assert bool((scale[tokens - 1] == MIN_SCALE).all())
    _check_scales(scale, activation.act_and_mul(gate_up.cpu(), act), group, dtype)


@pytest.mark.parametrize("tokens", [1, 5])
def test_silu_and_mul_quantized_in_groups_takes_the_interleaved_order(elementwise_case, tokens):
    """gate_up in runs of 8 gate then 8 up columns (activation.GATE_UP_INTERLEAVE): the two kernels' output too."""
    from llmc.kernels.activation_triton import act_and_mul, act_and_mul_fp8_groups
    from llmc.kernels.fp8_triton import quantize_fp8_per_token_group as quantize_groups_kernel

    device, dtype = elementwise_case
    gate_up = (3 * torch.randn(tokens, 2 * 160)).to(dtype).to(device)
    rows = cublas_rows(tokens)
    _assert_same(act_and_mul_fp8_groups(gate_up, MIN_SCALE, "silu", 128, rows, interleave=8),
                 quantize_groups_kernel(act_and_mul(gate_up, "silu", 8), 128, MIN_SCALE, rows=rows))


def test_group_outputs_on_cpu_are_the_two_steps() -> None:
    """Without Triton the public functions with a group_size are the norm / act · mul followed by the group
    quantization's torch path (unpadded), as Fp8BlockActivations."""
    x, residual = torch.randn(3, 200, dtype=torch.bfloat16), torch.randn(3, 200, dtype=torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(200)).to(torch.bfloat16)
    quantized, new_residual = norm.rms_norm_fp8(x, weight, 1e-6, residual, group_size=128)
    normed, expected_residual = norm.add_rms_norm(x, residual, weight, 1e-6)
    assert isinstance(quantized, Fp8BlockActivation) and torch.equal(new_residual, expected_residual)
    assert (quantized.shape, quantized.dtype, quantized.group_size) == (x.shape, torch.bfloat16, 128)
    _assert_same(quantized[:2], quantize_fp8_per_token_group(normed, 128))
    quantized, no_residual = norm.rms_norm_fp8(x, weight, 1e-6, group_size=64)
    assert no_residual is None
    _assert_same(quantized[:2], quantize_fp8_per_token_group(norm.rms_norm(x, weight, 1e-6), 64))
    gate_up = torch.randn(3, 400, dtype=torch.bfloat16)
    quantized = activation.act_and_mul_fp8(gate_up, "gelu_pytorch_tanh", group_size=128)
    assert quantized.shape == (3, 200)
    _assert_same(quantized[:2], quantize_fp8_per_token_group(activation.act_and_mul(gate_up, "gelu_pytorch_tanh"), 128))


def test_a_block_model_takes_its_input_from_the_fused_kernels(tmp_path, monkeypatch):
    """A bf16 block build of a tiny Llama (hidden 256, intermediate 384: 2 and 3 groups of 128) with its norm, act ·
    mul and group quantization run as Triton kernels in the interpreter (the products in float32; the interpreter is
    set for this directory before triton loads): the fused kernels' padded activations give the logits of the norm's
    and SiLU · mul's kernels followed by the group quantization's kernel, bit for bit, in prefill chunks of 16
    tokens and of 3 (decode-sized steps). On a GPU: tests/quant/test_fp8_block.py's cuda case."""
    if torch.cuda.is_available():
        pytest.skip("the CPU's Triton interpreter (on a GPU the kernels themselves: tests/quant/test_fp8_block.py)")
    pytest.importorskip("triton")
    from llmc.kernels import fp8
    from llmc.runtime.llm import LLM
    from tests.conftest import make_hf_checkpoint
    from tests.quant.test_fp8_block import build_block_bf16, score_fused_and_not

    checkpoint = make_hf_checkpoint(tmp_path / "ck", "llama", hidden_size=256, intermediate_size=384,
                                    num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2)
    artifact = build_block_bf16(checkpoint, tmp_path / "q")
    from llmc.kernels import activation_triton, norm_triton

    for module in (activation, fp8, norm):
        monkeypatch.setattr(module, "can_use_triton", lambda *tensors: True)
    launches = []  # the fused kernels' hosts, counted
    for module, name in ((norm_triton, "rms_norm_fp8_groups"), (activation_triton, "act_and_mul_fp8_groups")):
        def counted(*args, _kernel=getattr(module, name), _name=name, **kwargs):
            launches.append(_name)
            return _kernel(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    for chunk, token_ids in ((16, list(range(5, 42))), (3, list(range(5, 12)))):
        with LLM(artifact, device="cpu", max_num_batched_tokens=chunk) as llm:
            fused, unfused = score_fused_and_not(llm, token_ids)
        assert torch.equal(fused, unfused), chunk
    assert launches.count("rms_norm_fp8_groups") and launches.count("act_and_mul_fp8_groups")


_COMPILE_SM90 = r"""
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llmc.kernels import activation_triton, norm_triton

def compile_90(fn, signature, constants, num_warps):
    constants = {**constants, "PDL": True}
    source = ASTSource(fn, {**signature, **{k: "constexpr" for k in constants}}, constants, {})
    try:
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    except FileNotFoundError as exc:  # a triton without its bundled ptxas
        print("SKIP", exc)
        raise SystemExit(0)

facts = {}
def record(name, kernel):
    facts[name] = {"local": ".local" in kernel.asm["ptx"], "fp8": "e4m3" in kernel.asm["ptx"]}

norm = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp8e4nv", "res_out_ptr": "*bf16",
        "scale_ptr": "*fp32", "perm_ptr": "*bf16", "hidden": "i32", "inner": "i32", "stride_x_outer": "i32",
        "stride_x_inner": "i32", "stride_res": "i32", "eps": "fp32", "min_scale": "fp32", "num_rows": "i32"}
for block, group in ((4096, 128), (8192, 128), (64, 64)):
    for residual in (False, True):
        record(f"norm {block} {group} {residual}", compile_90(norm_triton._rms_norm_kernel, norm, {
            "HAS_RESIDUAL": residual, "FP8_OUT": True, "PERM": False, "BLOCK": block, "GROUP": group},
            min(16, max(1, block // 256))))
act = {"gate_up_ptr": "*bf16", "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "M": "i32", "size": "i32",
       "stride_in": "i32", "min_scale": "fp32"}
for code in (0, 1):
    record(f"act {code}", compile_90(activation_triton._act_and_mul_fp8_groups_kernel, act,
                                     {"INTERLEAVE": 0, "GROUP": 128, "GROUPS": 16, "ACT": code}, 4))
print(json.dumps(facts))
"""


def test_the_fused_kernels_compile_for_sm90_without_spills() -> None:
    """The group-quantizing norm (Llama widths, with and without the residual) and SiLU / GELU · mul kernels compiled
    for an H100 / H200 with the installed triton, no GPU needed: they compile, write E4M3, and spill nothing to local
    memory (the norm's row reshaped to a [groups, 128] tile stays in registers)."""
    facts = sm90_compile_facts(_COMPILE_SM90)
    assert len(facts) == 8 and all(fact == {"local": False, "fp8": True} for fact in facts.values()), facts
