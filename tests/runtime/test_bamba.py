"""Bamba (BambaForCausalLM) against transformers' own model (float32) on a tiny random checkpoint (tests/conftest.py:
[mamba, attention, mamba] by attn_layer_indices [1], test_granite4_hybrid's Mamba-2 sizes, the attention rotating the
leading half of each head, a dense SwiGLU MLP): logits of a prefill in chunks of 16, greedy tokens and logprobs of
prompts batched on fewer seats than prompts, also with the attention on its Triton kernels (interpreted) and with decode
steps through a decode graph's static buffers; greedy tokens under preemption by recompute and in chunks of 5; RTN and
GPTQ W4 builds against transformers holding their dequantized weights; how the config is read (the partial rotary,
BambaConfig's defaults and their parameter count); the refusals; -m gpu: CUDA (written, not run here)."""

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (triton reads it then)

import pytest
import torch

from llmc.compiler.export import export_artifact
from llmc.compiler.hf_checkpoint import model_config_from_hf, read_hf_config, rotary_row_permutation
from llmc.errors import ArtifactError, CheckpointError
from llmc.runtime.artifact import FORMAT_VERSION, read_manifest
from llmc.runtime.llm import LLM
from llmc.runtime.models import bamba
from tests.runtime.hf_oracle import (build_quantized, check_against_oracle, hf_model_on_weights_of, hf_state_of,
                                     hybrid_quantization)
from tests.runtime.hf_oracle import family_fixtures
from tests.runtime.test_glm4_moe import PROMPTS, _check
from tests.runtime.test_glm4_moe import triton_dispatch  # noqa: F401 (a fixture)
from tests.runtime.test_granite4_hybrid import check_on_the_gpu
from tests.runtime.test_granite4_hybrid import test_preemption_and_short_chunks_keep_transformers_tokens as preemption
from tests.runtime.test_qwen3_5 import check_16_bit_states_on_the_gpu
from tests.runtime.test_qwen3_5 import check_hybrid_refusals, check_memory_profile_forward
from tests.runtime.test_qwen3_5 import test_decodes_through_the_graphs_static_buffers as qwen_static_decodes
from tests.runtime.test_qwen3_5 import test_the_triton_path_matches_transformers as qwen_triton
from tests.runtime.test_qwen3_5 import PREEMPTION_CASES


checkpoint, artifact = family_fixtures("bamba", "bamba")


@torch.inference_mode()
def test_logits_greedy_and_logprobs_match_transformers(checkpoint, artifact, hf_logits, hf_greedy, hf_encode):
    """Logits over 40 positions prefilled in chunks of 16 (1e-4), greedy tokens of 3 prompts on 2 seats and their
    logprobs as transformers'; the manifest's Mamba-2 layers, the rotary over 8 of 16 dims (rows permuted to a
    whole-head table), one KV cache (the attention layer's)."""
    manifest = read_manifest(artifact)
    m = manifest.model
    assert manifest.format_version == FORMAT_VERSION == "1.47"
    assert (m.family, m.mamba_layers, m.kv_layers, m.mamba_num_heads, m.mamba_head_dim, m.mamba_n_groups,
            m.mamba_d_state, m.rotary_dim, m.rotary_rows_permuted, m.intermediate_size, m.moe_layers) == (
        "bamba", [0, 2], [1], 8, 16, 2, 16, 8, True, 128, [])
    with LLM(artifact, device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        _check(llm, checkpoint, hf_logits, hf_greedy, hf_encode)
        assert len(llm.engine.runner.kv_caches) == 1


# -m slow: the state kernels' interpreted run is Qwen3.5's, Granite 4.0's, OLMo Hybrid's and LFM2's in the default run
@pytest.mark.slow
def test_the_triton_path_matches_transformers(checkpoint, artifact, triton_dispatch, hf_logits, hf_greedy,  # noqa: F811
                                              hf_encode):
    """Qwen3.5's test on this model: the attention layer's rotary (the whole-head table, its pass-through pairs cos 1,
    sin 0) + KV write and paged attention on their Triton kernels (interpreted), the Mamba-2 layers' conv and SSD on
    theirs: transformers' logits, greedy tokens, logprobs."""
    qwen_triton(checkpoint, artifact, triton_dispatch, hf_logits, hf_greedy, hf_encode)


def test_decodes_through_the_graphs_static_buffers(checkpoint, artifact, hf_logits, hf_greedy, hf_encode):
    """Qwen3.5's test on this model: decode steps padded to 4 rows whose padding rows write the scratch state slot:
    transformers' greedy tokens and logprobs."""
    qwen_static_decodes(checkpoint, artifact, hf_logits, hf_greedy, hf_encode)


@PREEMPTION_CASES
def test_preemption_and_short_chunks_keep_transformers_tokens(options, checkpoint, artifact, hf_encode):
    """test_granite4_hybrid's test on this model: preempted requests prefilled again from zero state, or chunks of 5:
    transformers' greedy tokens, no block or state slot left held."""
    preemption(options, checkpoint, artifact, hf_encode)


def _hf_state(artifact) -> dict:
    """hf_state_of's, with q_proj's and k_proj's rows permuted back out of the runtime's whole-head rotate-half."""
    state, model = hf_state_of(artifact), read_manifest(artifact).model
    inverse = torch.argsort(rotary_row_permutation(model))
    for i in model.kv_layers:
        for name in ("q_proj", "k_proj"):
            key = f"model.layers.{i}.self_attn.{name}.weight"
            state[key] = state[key].unflatten(0, (-1, model.head_dim))[:, inverse].flatten(0, 1)
    return state


@torch.inference_mode()
@pytest.mark.parametrize("method", ["rtn",
                                    *(pytest.param(m, marks=pytest.mark.slow) for m in ("gptq", "fp8"))])
def test_a_w4_build_runs_transformers_on_its_weights(method, checkpoint, tmp_path, data_dir, hf_encode):
    """RTN and GPTQ (calibrated through the Mamba-2 layers from zero state) W4 of every linear (in_proj, out_proj, the
    attention's, feed_forward's) against transformers holding the dequantized weights (the conv, dt_bias, A_log, D and
    the gated norm dense). FP8 W8A8 of the linears too (hf_oracle.hybrid_quantization), each FP8 input rounded in
    transformers as the scheme rounds it."""
    quantization, fmt, check = hybrid_quantization(method)
    out = build_quantized(checkpoint, tmp_path, data_dir, quantization)
    oracle = hf_model_on_weights_of(checkpoint, out, method, _hf_state(out))
    check_against_oracle(LLM(out, device="cpu", max_num_batched_tokens=16), oracle, checkpoint, hf_encode, PROMPTS,
                         **check)
    modules = read_manifest(out).quant.modules
    assert {modules[f"layers.{i}.{name}"]["format"] for i, name in
            [(0, "attn.mamba_in"), (2, "attn.mamba_out"), (1, "attn.qkv"), (1, "attn.o"), (0, "mlp.gate_up"),
             (2, "mlp.down")]} == {fmt}


def test_the_config_reads_as_transformers(checkpoint):
    """BambaConfig's partial rotary: the rope parameters' factor (1.0: whole heads), else 0.5 whatever the top level
    says, also for a published config's rope_theta without rope_parameters; its defaults (attn_layer_indices given)
    read with their parameter count transformers' (a model on the meta device)."""
    from transformers import AutoModelForCausalLM, BambaConfig

    config = read_hf_config(checkpoint)
    whole = {**config, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}}
    assert model_config_from_hf(whole, bamba.SPEC, "float32").rotary_dim is None
    legacy = {k: v for k, v in config.items() if k != "rope_parameters"} | {"rope_theta": 5e5,
                                                                             "partial_rotary_factor": 1.0}
    read = model_config_from_hf(legacy, bamba.SPEC, "float32")
    assert (read.rotary_dim, read.rope_theta) == (8, 5e5)
    assert BambaConfig(rope_theta=5e5, partial_rotary_factor=1.0).rope_parameters["partial_rotary_factor"] == 0.5
    hf_config = BambaConfig(num_hidden_layers=4, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                            mamba_n_heads=8, mamba_d_state=32, attn_layer_indices=[2])
    model = model_config_from_hf({**hf_config.to_dict(), "architectures": ["BambaForCausalLM"]}, bamba.SPEC,
                                 "bfloat16")
    assert (model.mamba_layers, model.kv_layers, model.mamba_head_dim, model.rotary_dim, model.num_kv_heads) == (
        [0, 1, 3], [2], 64, 16, 8)
    with torch.device("meta"):
        assert model.num_parameters == AutoModelForCausalLM.from_config(hf_config).num_parameters()


def test_what_bamba_refuses(checkpoint, artifact, tmp_path):
    """Qwen3.5's hybrid refusals (prefix caching, speculation, LoRA, multi-step; ONNX, tensor parallel, int8); no
    attention layer (attn_layer_indices null or empty), an index past the layers, attention_bias / mlp_bias,
    mamba_proj_bias, a time_step_limit; `llmc export`."""
    refused = check_hybrid_refusals(checkpoint, artifact, tmp_path, "BambaForCausalLM")
    refused(CheckpointError, r"attn_layer_indices None: every layer Mamba-2 .* is not supported",
            attn_layer_indices=None)
    refused(CheckpointError, r"attn_layer_indices \[\]: every layer Mamba-2", attn_layer_indices=[])
    refused(CheckpointError, r"attn_layer_indices \[1, 3\]: indices must be layers 0 to 2", attn_layer_indices=[1, 3])
    refused(CheckpointError, "attention_bias: true is not supported for Bamba", attention_bias=True)
    refused(CheckpointError, "mlp_bias: true is not supported for Bamba", mlp_bias=True)
    refused(CheckpointError, "mamba_proj_bias: true is not supported for Bamba", mamba_proj_bias=True)
    refused(CheckpointError, "time_step_limit .* is not supported for Bamba", time_step_limit=[0.0, 10.0])
    with pytest.raises(ArtifactError, match="cannot export architecture BambaForCausalLM: a hybrid model"):
        export_artifact(artifact, tmp_path / "export")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_on_the_gpu(checkpoint, artifact, hf_logits, hf_greedy, hf_encode, free_gpu):
    from transformers.models.bamba.modeling_bamba import BambaRMSNormGated

    check_on_the_gpu(checkpoint, artifact, hf_logits, hf_greedy, hf_encode, BambaRMSNormGated)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_16_bit_states_on_the_gpu(checkpoint, artifact, hf_encode, free_gpu):
    """Both Mamba-2 states in float16 (mamba_cache_dtype), then the SSM state alone in bfloat16."""
    check_16_bit_states_on_the_gpu(checkpoint, artifact, hf_encode, mamba_cache_dtype="float16")
    check_16_bit_states_on_the_gpu(checkpoint, artifact, hf_encode, mamba_ssm_cache_dtype="bfloat16")


def test_the_gpu_memory_profile_runs_the_hybrid(checkpoint, artifact, monkeypatch, hf_logits):
    check_memory_profile_forward(checkpoint, artifact, monkeypatch, hf_logits)
