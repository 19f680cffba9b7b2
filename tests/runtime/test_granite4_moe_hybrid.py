"""Granite 4.0's MoE hybrids (GraniteMoeHybridForCausalLM with experts: granite-4.0-h-tiny, granite-4.0-h-small)
against transformers' own model (float32) on a tiny random checkpoint: test_granite4_hybrid's [mamba, attention, mamba]
layers and sizes, every layer's MLP 4 fused experts of width 32 (top 2: the softmax of the top-2 router logits) beside
its shared_mlp (96 wide, the shared expert): logits of a prefill in chunks of 16, greedy tokens and logprobs of prompts
batched on fewer seats than prompts, also with the attention on its Triton kernels (interpreted) and with decode steps
through a decode graph's static buffers; greedy tokens under preemption by recompute and in chunks of 5; the weights
as the checkpoint's (the experts' slices, the shared expert, residual_multiplier folded) and the shared expert
mattering; RTN and GPTQ W4 builds (experts, shared expert, Mamba-2 and attention linears quantized) against
transformers holding their dequantized weights; the parameter count of GraniteMoeHybridConfig's defaults (experts
included); the hybrid refusals (expert parallel among them); -m gpu: CUDA (written, not run here)."""

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (triton reads it then)

import pytest
import torch
from safetensors.torch import load_file

from llmc.errors import CheckpointError, RecipeError
from llmc.runtime.artifact import FORMAT_VERSION, read_manifest
from llmc.runtime.llm import LLM
from tests.runtime.hf_oracle import build_float32, check_quantized_build, hybrid_quantization
from tests.runtime.hf_oracle import family_fixtures
from tests.runtime.test_glm4_moe import PROMPTS, _check
from tests.runtime.test_glm4_moe import triton_dispatch  # noqa: F401 (a fixture)
from tests.runtime.test_granite4_hybrid import MAMBA, check_on_the_gpu
from tests.runtime.test_granite4_hybrid import test_preemption_and_short_chunks_keep_transformers_tokens as preemption
from tests.runtime.test_qwen3_5 import check_hybrid_refusals, check_memory_profile_forward
from tests.runtime.test_qwen3_5 import test_decodes_through_the_graphs_static_buffers as qwen_static_decodes
from tests.runtime.test_qwen3_5 import test_the_triton_path_matches_transformers as qwen_triton
from tests.runtime.test_qwen3_5 import PREEMPTION_CASES

EXPERTS = {**MAMBA, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32}


checkpoint, artifact = family_fixtures("granite4_moe_hybrid", "granitemoehybrid", **EXPERTS)


@torch.inference_mode()
def test_logits_greedy_and_logprobs_match_transformers(checkpoint, artifact, hf_logits, hf_greedy, hf_encode):
    """Logits over 40 positions prefilled in chunks of 16 (1e-4), greedy tokens of 3 prompts on 2 seats and their
    logprobs as transformers'; the manifest's experts in every layer (Mamba-2 and attention) beside the shared one."""
    manifest = read_manifest(artifact)
    m = manifest.model
    assert manifest.format_version == FORMAT_VERSION
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.shared_expert_intermediate_size,
            m.shared_expert_gate, m.norm_topk_prob, m.moe_layers, m.mamba_layers, m.kv_layers) == (
        4, 2, 32, 96, False, True, [0, 1, 2], [0, 2], [1])
    with LLM(artifact, device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        _check(llm, checkpoint, hf_logits, hf_greedy, hf_encode)
        assert all(layer.is_moe for layer in llm.engine.runner.model.layers.values())


@torch.inference_mode()
def test_the_weights_are_the_checkpoints_and_the_shared_expert_matters(checkpoint, artifact, hf_logits, hf_encode):
    """Expert e's gate_up is block_sparse_moe.input_linear[e], its down output_linear[e] times residual_multiplier
    (0.3, folded as o_proj's and mamba.out_proj's), the router router.layer, the shared expert shared_mlp's (its down
    folded too) under moe.shared.* and no dense mlp.*; num_parameters is transformers'; transformers' model without
    its shared_mlp is far from the model (the logits test checks it)."""
    from transformers import AutoModelForCausalLM

    hf = load_file(checkpoint / "model.safetensors")
    ours = load_file(artifact / "rank-00" / "weights.safetensors")
    exact = {"rtol": 0, "atol": 0}
    for i in range(3):
        theirs, mine = f"model.layers.{i}.", f"layers.{i}."
        torch.testing.assert_close(ours[mine + "moe.experts.gate_up.weight"],
                                   hf[theirs + "block_sparse_moe.input_linear.weight"], **exact)
        torch.testing.assert_close(ours[mine + "moe.experts.down.weight"],
                                   hf[theirs + "block_sparse_moe.output_linear.weight"] * 0.3)
        torch.testing.assert_close(ours[mine + "moe.gate.weight"], hf[theirs + "block_sparse_moe.router.layer.weight"],
                                   **exact)
        torch.testing.assert_close(ours[mine + "moe.shared.gate_up.weight"],
                                   hf[theirs + "shared_mlp.input_linear.weight"], **exact)
        torch.testing.assert_close(ours[mine + "moe.shared.down.weight"],
                                   hf[theirs + "shared_mlp.output_linear.weight"] * 0.3)
        assert not any(name.startswith(mine + "mlp.") for name in ours)
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    assert read_manifest(artifact).model.num_parameters == sum(p.numel() for p in model.parameters())
    token_ids = hf_encode(checkpoint, PROMPTS[1]) + list(range(100, 126))
    expected = hf_logits(checkpoint, token_ids)
    for layer in model.model.layers:
        torch.nn.init.zeros_(layer.shared_mlp.output_linear.weight)
    moved = model(torch.tensor([token_ids])).logits[0]
    assert (moved - expected).abs().mean() > 0.05 * expected.abs().mean()


# -m slow: the state kernels' interpreted run is Qwen3.5's, Granite 4.0's, OLMo Hybrid's and LFM2's in the default run
@pytest.mark.slow
def test_the_triton_path_matches_transformers(checkpoint, artifact, triton_dispatch, hf_logits, hf_greedy,  # noqa: F811
                                              hf_encode):
    """Qwen3.5's test on this model: the attention layer on its Triton kernels (interpreted), the Mamba-2 layers' conv
    and SSD recurrence on theirs, the experts in torch: transformers' logits, greedy tokens, logprobs."""
    qwen_triton(checkpoint, artifact, triton_dispatch, hf_logits, hf_greedy, hf_encode)


def test_decodes_through_the_graphs_static_buffers(checkpoint, artifact, hf_logits, hf_greedy, hf_encode):
    """Qwen3.5's test on this model: decode steps padded to 4 rows (the padding rows routed through the experts too,
    their states on the scratch slot): transformers' greedy tokens and logprobs."""
    qwen_static_decodes(checkpoint, artifact, hf_logits, hf_greedy, hf_encode)


@PREEMPTION_CASES
def test_preemption_and_short_chunks_keep_transformers_tokens(options, checkpoint, artifact, hf_encode):
    """test_granite4_hybrid's test on this model: preempted requests prefilled again from zero state, or chunks of 5:
    transformers' greedy tokens, no block or state slot left held."""
    preemption(options, checkpoint, artifact, hf_encode)


@torch.inference_mode()
@pytest.mark.parametrize("method", ["rtn",
                                    *(pytest.param(m, marks=pytest.mark.slow) for m in ("gptq", "fp8"))])
def test_a_w4_build_runs_transformers_on_its_weights(method, checkpoint, tmp_path, data_dir, hf_encode):
    """RTN and GPTQ (the experts' Hessians from the tokens routed to each) W4 of every linear: the experts, the shared
    expert, the Mamba-2 layers' in_proj and out_proj, the attention's; the router dense: against transformers holding
    the dequantized weights (its experts stacked as it holds them). FP8 W8A8 of the linears too
    (hf_oracle.hybrid_quantization), each FP8 input rounded in transformers as the scheme rounds it."""
    quantization, fmt, check = hybrid_quantization(method, experts=True)
    check_quantized_build(checkpoint, tmp_path, data_dir, hf_encode, quantization, PROMPTS, **check)
    modules = read_manifest(tmp_path / "q").quant.modules
    assert {modules[f"layers.{i}.{name}"]["format"] for i, name in
            [(2, "moe.shared.gate_up"), (0, "moe.shared.down"), (0, "attn.mamba_in"), (1, "attn.qkv")]} == {fmt}
    assert {modules[f"layers.{i}.moe.experts.{name}"]["format"] for i, name in [(0, "gate_up"), (1, "down")]} == {
        "dense" if method == "fp8" else fmt}
    assert "layers.0.moe.gate" not in modules and "layers.0.mlp.gate_up" not in modules


def test_the_default_config_reads_as_transformers():
    """GraniteMoeHybridConfig's defaults (8 experts, top 2, mamba_d_head auto), smaller: the manifest's experts in
    every layer and its parameter count transformers' (a model on the meta device)."""
    from transformers import AutoModelForCausalLM, GraniteMoeHybridConfig

    from llmc.compiler.hf_checkpoint import model_config_from_hf
    from llmc.runtime.models import granitemoehybrid

    kinds = ["mamba", "attention", "mamba", "mamba"]
    hf_config = GraniteMoeHybridConfig(num_hidden_layers=4, intermediate_size=128, shared_intermediate_size=512,
                                       hidden_size=256, mamba_n_heads=8, mamba_d_state=32, layer_types=kinds)
    config = {**hf_config.to_dict(), "architectures": ["GraniteMoeHybridForCausalLM"], "layer_types": kinds}
    model = model_config_from_hf(config, granitemoehybrid.SPEC, "bfloat16")
    assert (model.num_experts, model.num_experts_per_tok, model.moe_intermediate_size,
            model.shared_expert_intermediate_size, model.moe_layers, model.mamba_layers) == (
        8, 2, 128, 512, [0, 1, 2, 3], [0, 2, 3])
    with torch.device("meta"):
        assert model.num_parameters == AutoModelForCausalLM.from_config(hf_config).num_parameters()


def test_what_a_granite4_moe_hybrid_refuses(checkpoint, artifact, tmp_path):
    """Qwen3.5's hybrid refusals (prefix caching, speculation, LoRA, multi-step; ONNX, tensor parallel, int8), expert
    parallel too (tensor 2, expert 2: one rank), and Granite's import (its folds)."""
    refused = check_hybrid_refusals(checkpoint, artifact, tmp_path, "GraniteMoeHybridForCausalLM")
    refused(RecipeError, "parallel: .* runs on one rank", recipe={"parallel": {"tensor": 2, "expert": 2}})
    with pytest.raises(CheckpointError, match="quantization.method import is not supported for Granite"):
        build_float32(checkpoint, tmp_path / "imported", quantization={"method": "import"})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_on_the_gpu(checkpoint, artifact, hf_logits, hf_greedy, hf_encode, free_gpu):
    """As Granite 4.0's dense hybrid, every layer's experts on the fused MoE kernel."""
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridRMSNormGated

    def runs_fused(runner):
        assert all(layer.moe.runs_fused() for layer in runner.model.layers.values())

    check_on_the_gpu(checkpoint, artifact, hf_logits, hf_greedy, hf_encode, GraniteMoeHybridRMSNormGated, runs_fused)


def test_the_gpu_memory_profile_runs_the_hybrid(checkpoint, artifact, monkeypatch, hf_logits):
    check_memory_profile_forward(checkpoint, artifact, monkeypatch, hf_logits)
