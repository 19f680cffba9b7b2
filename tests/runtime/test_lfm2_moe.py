"""LFM2-MoE (Lfm2MoeForCausalLM: LFM2-8B-A1B) against transformers' own model (float32) on a tiny random checkpoint of
LFM2's test layers ([conv, full_attention, conv]) with layer 0's feed-forward dense (num_dense_layers 1) and layers 1
and 2 8 experts of width 32 (top 2 of a sigmoid router chosen with a random expert_bias, renormalised, times 1.5):
logits over a chunked prefill, greedy tokens and logprobs, the bias shown to choose; RTN and GPTQ W4 (the experts too)
against transformers holding the dequantized weights; the parameter count of an Lfm2MoeConfig; its refusals (LFM2's
hybrid refusals: tests/runtime/test_lfm2.py); -m gpu: CUDA (written, not run here)."""

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (triton reads it then)

import pytest
import torch

from llmc.errors import CheckpointError
from llmc.runtime.artifact import read_manifest
from llmc.runtime.llm import LLM
from tests.conftest import make_hf_checkpoint
from tests.runtime.hf_oracle import build_float32, check_quantized_build, hybrid_quantization, write_config
from tests.runtime.hf_oracle import artifact_fixture
from tests.runtime.test_glm4_moe import PROMPTS, _check, _random_score_bias
from tests.runtime.test_lfm2 import check_on_the_gpu
from tests.runtime.test_qwen3_5 import check_memory_profile_forward


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The LFM2-MoE checkpoint with each sparse layer's expert_bias set at random (test_glm4_moe._random_score_bias)."""
    checkpoint = make_hf_checkpoint(tmp_path_factory.mktemp("lfm2_moe") / "ckpt", "lfm2_moe")
    _random_score_bias(checkpoint, mtp=False, bias="feed_forward.expert_bias")
    return checkpoint


artifact = artifact_fixture("lfm2_moe")


@torch.inference_mode()
def test_logits_greedy_and_logprobs_match_transformers(checkpoint, artifact, hf_logits, hf_greedy, hf_encode):
    """Logits over 40 positions prefilled in chunks of 16 (1e-4), greedy tokens of 3 prompts on 2 seats and their
    logprobs as transformers'; the manifest's sparse layers and router; transformers with the expert_bias zeroed gives
    other logits (the bias chooses experts here)."""
    from transformers import AutoModelForCausalLM

    m = read_manifest(artifact).model
    assert (m.family, m.moe_layers, m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size,
            m.router_scoring, m.router_score_bias, m.routed_scaling_factor, m.norm_topk_prob, m.intermediate_size,
            m.short_conv_layers) == ("lfm2_moe", [1, 2], 8, 2, 32, "sigmoid", True, 1.5, True, 128, [0, 2])
    with LLM(artifact, device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        _check(llm, checkpoint, hf_logits, hf_greedy, hf_encode)
        token_ids = hf_encode(checkpoint, PROMPTS[1]) + list(range(100, 126))
        got = llm.engine.score(token_ids)
    unbiased = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    for layer in (1, 2):
        unbiased.model.layers[layer].feed_forward.expert_bias.zero_()
    assert (unbiased(torch.tensor([token_ids])).logits[0] - got).abs().max() > 0.1


@torch.inference_mode()
@pytest.mark.parametrize("method", ["rtn",
                                    *(pytest.param(m, marks=pytest.mark.slow) for m in ("gptq", "fp8"))])
def test_a_w4_build_runs_transformers_on_its_weights(method, checkpoint, tmp_path, data_dir, hf_encode):
    """RTN and GPTQ W4 of every linear and expert against transformers holding its dequantized weights (the router and
    its expert_bias dense, float32). FP8 W8A8 of the linears too (hf_oracle.hybrid_quantization), each FP8 input rounded
    in transformers as the scheme rounds it."""
    quantization, fmt, check = hybrid_quantization(method, experts=True)
    check_quantized_build(checkpoint, tmp_path, data_dir, hf_encode,
                          quantization, PROMPTS, **check)
    modules = read_manifest(tmp_path / "q").quant.modules
    assert {modules[f"layers.{i}.{name}"]["format"] for i, name in [(0, "mlp.gate_up"), (0, "attn.conv_in")]} == {fmt}
    assert {modules[f"layers.{i}.moe.experts.{name}"]["format"] for i, name in [(1, "gate_up"), (2, "down")]} == {
        "dense" if method == "fp8" else fmt}
    assert "layers.1.mlp.gate_up" not in modules


def test_the_config_reads_as_transformers_reads_it():
    """An Lfm2MoeConfig of 4 layers, 2 dense: the sparse layers and the parameter count transformers' (a model on
    the meta device)."""
    from transformers import AutoModelForCausalLM, Lfm2MoeConfig

    from llmc.compiler.hf_checkpoint import model_config_from_hf
    from llmc.runtime.models import lfm2

    config = {"architectures": ["Lfm2MoeForCausalLM"], "model_type": "lfm2_moe", "vocab_size": 1000,
              "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 64, "num_experts": 8,
              "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "num_dense_layers": 2,
              "layer_types": ["conv", "conv", "full_attention", "conv"]}
    model = model_config_from_hf(config, lfm2.MOE_SPEC, "bfloat16")
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(Lfm2MoeConfig(**{k: v for k, v in config.items()
                                                                if k not in ("architectures", "model_type")}))
    assert (model.moe_layers, model.kv_layers, model.intermediate_size, model.num_experts_per_tok) == (
        [2, 3], [2], 512, 4)
    assert model.num_parameters == hf.num_parameters()


def test_what_lfm2_moe_refuses(checkpoint, tmp_path):
    """use_expert_bias false, layer_types absent (transformers' LFM2-MoE needs it), num_dense_layers leaving
    no sparse layer, refused by name at build."""
    for match, changes in [("use_expert_bias false is not supported", {"use_expert_bias": False}),
                           ("layer_types is needed", {"layer_types": None}),
                           ("num_dense_layers 3: .* no sparse layer", {"num_dense_layers": 3})]:
        source = write_config(checkpoint, tmp_path / f"c{len(list(tmp_path.iterdir()))}", **changes)
        with pytest.raises(CheckpointError, match=match):
            build_float32(source, tmp_path / "out")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_on_the_gpu(checkpoint, artifact, hf_logits, hf_greedy, hf_encode, free_gpu):
    """LFM2's GPU case on this model (the experts on the fused MoE kernel where the GPU runs it): transformers' logits
    (2e-3), greedy tokens and logprobs, with decode graphs and eager."""
    check_on_the_gpu(checkpoint, artifact, hf_logits, hf_greedy, hf_encode)


def test_the_gpu_memory_profile_runs_the_hybrid(checkpoint, artifact, monkeypatch, hf_logits):
    check_memory_profile_forward(checkpoint, artifact, monkeypatch, hf_logits)
