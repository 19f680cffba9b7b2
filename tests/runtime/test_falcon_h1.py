"""Falcon-H1 (FalconH1ForCausalLM) against transformers' own model (float32) on a tiny random checkpoint
(tests/conftest.py: 2 layers, each GQA 4/2 beside a Mamba-2 mixer of 8 heads of 16 in 2 groups, their outputs summed;
every muP multiplier away from 1): logits of a prefill in chunks of 16, greedy tokens and logprobs of prompts batched on
fewer seats than prompts, also with the attention on its Triton kernels (interpreted) and with decode steps through a
decode graph's static buffers; greedy tokens under preemption by recompute and in chunks of 5; mamba_rms_norm true
(the gated norm per group); RTN and GPTQ W4 builds against transformers holding their dequantized weights (the
multipliers folded in them: a config with those at 1); FalconH1Config's defaults read with their parameter count; the
refusals; the GPU memory profile's forward; -m gpu: CUDA (written, not run here)."""

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (triton reads it then)

import pytest
import torch

from llmc.compiler.export import export_artifact
from llmc.compiler.hf_checkpoint import model_config_from_hf
from llmc.errors import ArtifactError, CheckpointError
from llmc.runtime.artifact import FORMAT_VERSION, read_manifest
from llmc.runtime.llm import LLM
from llmc.runtime.models import falcon_h1
from tests.conftest import FALCON_H1_MULTIPLIERS, make_hf_checkpoint
from tests.runtime.hf_oracle import (build_quantized, check_against_oracle, float32_artifacts, hf_model_on_weights_of,
                                     hf_state_of, hybrid_quantization, write_config)
from tests.runtime.hf_oracle import family_fixtures
from tests.runtime.test_glm4_moe import PROMPTS, _check
from tests.runtime.test_glm4_moe import triton_dispatch  # noqa: F401 (a fixture)
from tests.runtime.test_granite4_hybrid import check_on_the_gpu
from tests.runtime.test_granite4_hybrid import test_preemption_and_short_chunks_keep_transformers_tokens as preemption
from tests.runtime.test_qwen3_5 import check_hybrid_refusals, check_memory_profile_forward
from tests.runtime.test_qwen3_5 import test_decodes_through_the_graphs_static_buffers as qwen_static_decodes
from tests.runtime.test_qwen3_5 import test_the_triton_path_matches_transformers as qwen_triton
from tests.runtime.test_qwen3_5 import PREEMPTION_CASES


checkpoint, artifact = family_fixtures("falcon_h1", "falcon_h1")


@torch.inference_mode()
def test_logits_greedy_and_logprobs_match_transformers(checkpoint, artifact, hf_logits, hf_greedy, hf_encode):
    """Logits over 40 positions prefilled in chunks of 16 (1e-4), greedy tokens of 3 prompts on 2 seats and their
    logprobs as transformers'; the manifest: every layer Mamba-2 with the attention beside it (a KV cache each), no
    gated norm, the embedding multiplier as the embeddings' scale."""
    manifest = read_manifest(artifact)
    m = manifest.model
    assert manifest.format_version == FORMAT_VERSION == "1.47"
    assert (m.family, m.mamba_layers, m.kv_layers, m.mamba_with_attention, m.mamba_rms_norm, m.mamba_num_heads,
            m.mamba_head_dim, m.mamba_n_groups, m.mamba_d_state, m.embed_scale, m.head_dim) == (
        "falcon_h1", [0, 1], [0, 1], True, False, 8, 16, 2, 16, 2.0, 16)
    assert {f"layers.0.{name}" for name in ("attn.qkv", "attn.o", "attn.mamba_in", "attn.mamba_out", "mlp.gate_up",
                                            "mlp.down")} == {k for k in manifest.quant.modules if k.startswith("layers.0.")}
    with LLM(artifact, device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        _check(llm, checkpoint, hf_logits, hf_greedy, hf_encode)
        runner = llm.engine.runner
        assert len(runner.kv_caches) == 2
        assert runner.model.layers["1"].attn.mamba.ssm_state.shape == (3, 8, 16, 16)  # max_num_seqs + 1 slots


# -m slow: the state kernels' interpreted run is Qwen3.5's, Granite 4.0's, OLMo Hybrid's and LFM2's in the default run
@pytest.mark.slow
def test_the_triton_path_matches_transformers(checkpoint, artifact, triton_dispatch, hf_logits, hf_greedy,  # noqa: F811
                                              hf_encode):
    """Qwen3.5's test on this model: every layer's rotary + KV write and paged attention on their Triton kernels
    (interpreted), the Mamba-2 mixers' conv and SSD beside them on theirs: transformers' logits, greedy tokens,
    logprobs."""
    qwen_triton(checkpoint, artifact, triton_dispatch, hf_logits, hf_greedy, hf_encode)


def test_decodes_through_the_graphs_static_buffers(checkpoint, artifact, hf_logits, hf_greedy, hf_encode):
    """Qwen3.5's test on this model: decode steps padded to 4 rows whose padding rows write the scratch state slot
    (and the scratch KV slots): transformers' greedy tokens and logprobs."""
    qwen_static_decodes(checkpoint, artifact, hf_logits, hf_greedy, hf_encode)


@PREEMPTION_CASES
def test_preemption_and_short_chunks_keep_transformers_tokens(options, checkpoint, artifact, hf_encode):
    """test_granite4_hybrid's test on this model: preempted requests prefilled again from zero state, or chunks of 5:
    transformers' greedy tokens, no block or state slot left held."""
    preemption(options, checkpoint, artifact, hf_encode)


@torch.inference_mode()
def test_the_gated_norm_matches_transformers(tmp_path, hf_logits, hf_greedy, hf_encode):
    """mamba_rms_norm true with mamba_norm_before_gate false: the mixer's output y silu(z) normed per group of heads
    (Granite 4.0's gated norm, the attn.norm tensor): transformers' logits, greedy tokens and logprobs."""
    checkpoint = make_hf_checkpoint(tmp_path / "normed", "falcon_h1", mamba_rms_norm=True,
                                    mamba_norm_before_gate=False)
    artifact = float32_artifacts({"n": checkpoint}, tmp_path / "artifacts")("n")
    assert read_manifest(artifact).model.mamba_rms_norm
    with LLM(artifact, device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        _check(llm, checkpoint, hf_logits, hf_greedy, hf_encode)


@torch.inference_mode()
@pytest.mark.parametrize("method", ["rtn",
                                    *(pytest.param(m, marks=pytest.mark.slow) for m in ("gptq", "fp8"))])
def test_a_w4_build_runs_transformers_on_its_weights(method, checkpoint, tmp_path, data_dir, hf_encode):
    """RTN and GPTQ (calibrated through the Mamba-2 mixers from zero state) W4 of every linear (q/k/v/o, in_proj,
    out_proj, feed_forward's) against transformers holding the dequantized weights, its config's multipliers at 1 (the
    build folded them into those weights) but embedding_multiplier (the runtime's embed_scale); the conv, dt_bias, A_log
    and D dense. FP8 W8A8 of the linears too (hf_oracle.hybrid_quantization), each FP8 input rounded in transformers as
    the scheme rounds it."""
    quantization, fmt, check = hybrid_quantization(method)
    out = build_quantized(checkpoint, tmp_path, data_dir, quantization)
    unfolded = write_config(checkpoint, tmp_path / "unfolded", **{
        key: [1.0] * len(value) if isinstance(value, list) else 1.0 for key, value in FALCON_H1_MULTIPLIERS.items()
        if key != "embedding_multiplier"})
    oracle = hf_model_on_weights_of(unfolded, out, method, hf_state_of(out))
    check_against_oracle(LLM(out, device="cpu", max_num_batched_tokens=16), oracle, checkpoint, hf_encode, PROMPTS,
                         **check)
    modules = read_manifest(out).quant.modules
    assert {modules[f"layers.{i}.{name}"]["format"] for i in range(2) for name in (
        "attn.mamba_in", "attn.mamba_out", "attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")} == {fmt}


def test_the_config_reads_as_transformers():
    """FalconH1Config's defaults (mamba_d_ssm 1024 in place of mamba_expand * hidden_size, mamba_d_head auto) read
    with their parameter count transformers' (a model on the meta device), also with mamba_rms_norm's gated norm."""
    from transformers import AutoModelForCausalLM, FalconH1Config

    for normed in (False, True):
        hf_config = FalconH1Config(num_hidden_layers=2, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                                   mamba_n_heads=16, mamba_d_state=32, mamba_rms_norm=normed,
                                   mamba_norm_before_gate=False, tie_word_embeddings=normed)
        model = model_config_from_hf({**hf_config.to_dict(), "architectures": ["FalconH1ForCausalLM"]},
                                     falcon_h1.SPEC, "bfloat16")
        assert (model.mamba_layers, model.kv_layers, model.mamba_head_dim, model.mamba_rms_norm, model.num_kv_heads,
                model.embed_scale) == ([0, 1], [0, 1], 64, normed, 8, None)
        with torch.device("meta"):
            assert model.num_parameters == AutoModelForCausalLM.from_config(hf_config).num_parameters()


def test_what_falcon_h1_refuses(checkpoint, artifact, tmp_path):
    """Qwen3.5's hybrid refusals (prefix caching, speculation, LoRA, multi-step; ONNX, tensor parallel, int8); biases
    (attention, MLP, out_proj's projectors_bias, in_proj's mamba_proj_bias), mamba_rms_norm with the norm before the
    gate, a time_step_limit, a multiplier that is not a number (or ssm_multipliers not five); `llmc export`."""
    refused = check_hybrid_refusals(checkpoint, artifact, tmp_path, "FalconH1ForCausalLM")
    for key in ("attention_bias", "mlp_bias", "projectors_bias", "mamba_proj_bias"):
        refused(CheckpointError, f"{key}: true is not supported for Falcon-H1", **{key: True})
    refused(CheckpointError, "mamba_rms_norm with mamba_norm_before_gate: true is not supported for Falcon-H1",
            mamba_rms_norm=True, mamba_norm_before_gate=True)
    refused(CheckpointError, "time_step_limit .* is not supported for Falcon-H1", time_step_limit=[0.0, 10.0])
    refused(CheckpointError, "key_multiplier None: Falcon-H1's multipliers are finite numbers", key_multiplier=None)
    refused(CheckpointError, r"ssm_multipliers \[1.0, 1.0\]: .* \(5 of them\)", ssm_multipliers=[1.0, 1.0])
    with pytest.raises(ArtifactError, match="cannot export architecture FalconH1ForCausalLM: a hybrid model"):
        export_artifact(artifact, tmp_path / "export")


def test_the_gpu_memory_profile_runs_the_hybrid(checkpoint, artifact, monkeypatch, hf_logits):
    check_memory_profile_forward(checkpoint, artifact, monkeypatch, hf_logits, every_layer_attends=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_on_the_gpu(checkpoint, artifact, hf_logits, hf_greedy, hf_encode, free_gpu):
    """test_granite4_hybrid's GPU case; the checkpoint has no gated norm (mamba_rms_norm false), so transformers'
    logits hold on any transformers version: the stand-in class below says per group."""
    def no_gated_norm(group_size=None):  # (check_on_the_gpu compares with transformers where this takes group_size)
        return None

    check_on_the_gpu(checkpoint, artifact, hf_logits, hf_greedy, hf_encode, no_gated_norm)
