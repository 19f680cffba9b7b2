"""NVIDIA Nemotron-H (NemotronHForCausalLM) against transformers' own model (float32) on a tiny random checkpoint whose
blocks are M - * M - - (a Mamba-2 mixer, an MLP, attention, a Mamba-2 mixer after it, two MLPs in a row; tests/conftest:
Mamba-2 of 8 heads of 16 in 2 groups, d_state 16, a conv of 4, chunks of 8; attention without rotary; relu2 MLPs):
each block one runtime layer (a mixer without MLP, an MLP without mixer). Logits at every position of a prefill in
chunks of 16, greedy tokens and logprobs of prompts batched on fewer seats than prompts, also with the attention on its
Triton kernels (interpreted) and with decode steps through a decode graph's static buffers; greedy tokens under
preemption by recompute (a tiny KV cache) and in chunks of 5; n = 2 and an abort mid-stream; RTN and GPTQ W4 builds
against transformers holding their dequantized weights; the older config spelling (hybrid_override_pattern, mamba_*
names) read as the newer, its MTP layers logged as not built; NemotronHConfig's default sizes and their parameter
count; the refusals; -m gpu: CUDA (written, not run here)."""

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (triton reads it then)

import json

import pytest
import torch

from llmc.compiler.export import export_artifact
from llmc.errors import ArtifactError, CheckpointError
from llmc.runtime.artifact import FORMAT_VERSION, read_manifest
from llmc.runtime.llm import LLM
from tests.runtime.hf_oracle import build_float32, check_quantized_build, hybrid_quantization, write_config
from tests.runtime.hf_oracle import family_fixtures
from tests.runtime.test_glm4_moe import PROMPTS, _check
from tests.runtime.test_glm4_moe import triton_dispatch  # noqa: F401 (a fixture)
from tests.runtime.test_granite4_hybrid import check_on_the_gpu
from tests.runtime.test_granite4_hybrid import \
    test_preemption_and_short_chunks_keep_transformers_tokens as granite_preemption
from tests.runtime.test_qwen3_5 import check_hybrid_refusals, check_memory_profile_forward
from tests.runtime.test_qwen3_5 import test_decodes_through_the_graphs_static_buffers as qwen_static_decodes
from tests.runtime.test_qwen3_5 import test_n_above_1_and_an_abort_mid_stream as qwen_abort
from tests.runtime.test_qwen3_5 import test_the_triton_path_matches_transformers as qwen_triton
from tests.runtime.test_qwen3_5 import PREEMPTION_CASES


checkpoint, artifact = family_fixtures("nemotron_h", "nemotron_h")


@torch.inference_mode()
def test_logits_greedy_and_logprobs_match_transformers(checkpoint, artifact, hf_logits, hf_greedy, hf_encode):
    """Logits over 40 positions prefilled in chunks of 16 (1e-4), greedy tokens of 3 prompts on 2 seats and their
    logprobs as transformers'; the manifest's single-mixer layers, Mamba-2 layers and relu2 MLP; one KV cache (the
    attention block's), no MLP in a mixer's layer, no attention in an MLP's."""
    manifest = read_manifest(artifact)
    m = manifest.model
    assert manifest.format_version == FORMAT_VERSION == "1.47"
    assert (m.no_mlp_layers, m.no_mixer_layers, m.mamba_layers, m.kv_layers, m.nope_layers, m.hidden_act) == (
        [0, 2, 3], [1, 4, 5], [0, 3], [2], list(range(6)), "relu2")
    assert (m.mamba_num_heads, m.mamba_head_dim, m.mamba_n_groups, m.mamba_d_state, m.mamba_conv_kernel,
            m.mamba_chunk_size, m.mamba_conv_bias, m.intermediate_size, m.head_dim) == (
        8, 16, 2, 16, 4, 8, True, 96, 16)
    assert set(manifest.quant.modules) == {"lm_head", *(f"layers.{i}.{name}" for i, names in enumerate(
        [("attn.mamba_in", "attn.mamba_out"), ("mlp.up", "mlp.down"), ("attn.qkv", "attn.o")]
        + [("attn.mamba_in", "attn.mamba_out")] + [("mlp.up", "mlp.down")] * 2) for name in names)}
    with LLM(artifact, device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        _check(llm, checkpoint, hf_logits, hf_greedy, hf_encode)
        runner = llm.engine.runner
        layers = runner.model.layers
        assert len(runner.kv_caches) == 1 and layers["2"].attn.kv_cache is runner.kv_caches[0]
        assert layers["1"].attn is None and not hasattr(layers["0"], "mlp") and not hasattr(layers["2"], "mlp")
        assert not any(hasattr(layer, "post_attn_norm") for layer in layers.values())
        assert layers["3"].attn.ssm_state.shape == (3, 8, 16, 16)  # max_num_seqs + 1 slots
        assert not llm.engine.options.enable_prefix_caching


@torch.inference_mode()
def test_transformers_dt_clamp_does_not_bind_here(checkpoint, hf_encode):
    """transformers' chunked scan clamps dt = softplus(dt_raw + dt_bias) below at time_step_min, which the runtime (as
    vLLM) does not: on the prompts the tests compare, every Mamba-2 block's dt stays above it, so the comparisons
    above hold the same model."""
    from tests.conftest import hf_model

    model, least = hf_model(checkpoint), []
    for i in (0, 3):
        mixer = model.model.layers[i].mixer
        mixer.in_proj.register_forward_hook(lambda _m, _a, out, mixer=mixer: least.append(
            torch.nn.functional.softplus(out[..., -mixer.num_heads:] + mixer.dt_bias).min()))
    try:
        for prompt in PROMPTS:
            model(torch.tensor([hf_encode(checkpoint, prompt) + list(range(100, 140))]))
    finally:
        for i in (0, 3):
            model.model.layers[i].mixer.in_proj._forward_hooks.clear()
    assert len(least) == 6 and min(least) > 2 * model.config.time_step_min


# -m slow: the state kernels' interpreted run is Qwen3.5's, Granite 4.0's, OLMo Hybrid's and LFM2's in the default run
@pytest.mark.slow
def test_the_triton_path_matches_transformers(checkpoint, artifact, triton_dispatch, hf_logits, hf_greedy,  # noqa: F811
                                              hf_encode):
    """Qwen3.5's test on this model: the attention block's KV write and paged attention on their Triton kernels (the
    interpreter on CPU tensors), the Mamba-2 mixers' conv and SSD on theirs, the MLPs in torch: transformers' logits,
    greedy tokens, logprobs."""
    qwen_triton(checkpoint, artifact, triton_dispatch, hf_logits, hf_greedy, hf_encode)


def test_decodes_through_the_graphs_static_buffers(checkpoint, artifact, hf_logits, hf_greedy, hf_encode):
    """Qwen3.5's test on this model: what a decode graph replays (runtime/cuda_graphs.py), on the CPU: decode steps
    padded to 4 rows whose padding rows write the scratch state slot, also with the first request finishing first:
    transformers' greedy tokens and logprobs."""
    qwen_static_decodes(checkpoint, artifact, hf_logits, hf_greedy, hf_encode)


@PREEMPTION_CASES
def test_preemption_and_short_chunks_keep_transformers_tokens(options, checkpoint, artifact, hf_encode):
    """Granite 4.0's test on this model: 3 prompts on 3 seats with 5 KV blocks (preempted, prefilled again from zero
    state), or in chunks of 5 tokens: transformers' greedy tokens, no block or row left held."""
    granite_preemption(options, checkpoint, artifact, hf_encode)


def test_n_above_1_and_an_abort_mid_stream(checkpoint, artifact, hf_encode):
    """Qwen3.5's test on this model: n = 2 samples of top_k 1 both transformers' greedy tokens; a request aborted
    after 3 tokens gives its slot back at once and the request that takes it next starts from zero state."""
    qwen_abort(checkpoint, artifact, hf_encode)


@torch.inference_mode()
@pytest.mark.parametrize("method", ["rtn",
                                    *(pytest.param(m, marks=pytest.mark.slow) for m in ("gptq", "fp8"))])
def test_a_w4_build_runs_transformers_on_its_weights(method, checkpoint, tmp_path, data_dir, hf_encode):
    """RTN and GPTQ (calibrated through the blocks in turn, the Mamba-2 ones from zero state) W4 of every linear (the
    Mamba-2 in_proj and out_proj, q/k/v and o, the MLPs' up and down) against transformers holding its dequantized
    weights (the conv, dt_bias, A_log, D and the gated norm dense). FP8 W8A8 of the linears too
    (hf_oracle.hybrid_quantization), each FP8 input rounded in transformers as the scheme rounds it."""
    quantization, fmt, check = hybrid_quantization(method)
    check_quantized_build(checkpoint, tmp_path, data_dir, hf_encode, quantization, PROMPTS, **check)
    modules = read_manifest(tmp_path / "q").quant.modules
    assert {modules[f"layers.{i}.{name}"]["format"] for i, name in
            [(0, "attn.mamba_in"), (3, "attn.mamba_out"), (2, "attn.qkv"), (1, "mlp.up"), (5, "mlp.down")]} == {fmt}


@torch.inference_mode()
def test_an_fp8_checkpoint_imports(checkpoint, tmp_path, hf_encode):
    """A block-FP8 checkpoint in transformers' `quant_method: fp8` layout (every linear: the Mamba-2 mixers' in_proj
    and out_proj, q/k/v/o, the MLPs' up and down, under backbone.layers.N.mixer) imports with `quantization.method:
    import` (hf_oracle.check_fp8_import): the checkpoint's dequantized blocks exactly, and transformers' logits and
    greedy tokens on them. (NVIDIA's Nemotron-H FP8 releases are ModelOpt's per-tensor FP8: not tested here.)"""
    from tests.runtime.hf_oracle import check_fp8_import, hf_state_of

    def state_of(out):
        linears = {}
        return hf_state_of(out, None, linears), linears

    quantized = check_fp8_import(checkpoint, checkpoint, tmp_path, hf_encode, PROMPTS, ("in_proj", "out_proj"), "fp8",
                                 state_of, lambda name: name.replace("backbone.", "model."))
    assert {name.rsplit(".", 1)[-1] for name in quantized} == {"in_proj", "out_proj", "q_proj", "k_proj", "v_proj",
                                                               "o_proj", "up_proj", "down_proj"}


def test_the_older_config_spelling_reads_the_same(checkpoint, artifact, tmp_path, caplog):
    """A config.json as NVIDIA's checkpoints write it (hybrid_override_pattern, num_hidden_layers, the mamba_* key
    names transformers renames, one MTP layer named by num_nextn_predict_layers): the same model and weights, and the
    build says the MTP layer is not built."""
    import logging

    from safetensors.torch import load_file

    config = json.loads((checkpoint / "config.json").read_text())
    config = {k: v for k, v in config.items() if k not in ("layers_block_type", "n_groups", "conv_kernel",
                                                            "chunk_size", "use_conv_bias")}
    config |= {"hybrid_override_pattern": "M-*M--", "num_hidden_layers": 6, "mamba_n_groups": 2, "mamba_d_conv": 4,
               "mamba_chunk_size": 8, "mamba_conv_bias": True, "num_nextn_predict_layers": 1}
    source = write_config(checkpoint, tmp_path / "older")
    (source / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.INFO, logger="llmc"):
        out = build_float32(source, tmp_path / "out")
    assert "num_nextn_predict_layers 1: the multi-token prediction layers are not built" in caplog.text
    assert read_manifest(out).model == read_manifest(artifact).model
    got, want = (load_file(a / "rank-00" / "weights.safetensors") for a in (out, artifact))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_the_default_config_reads_as_transformers():
    """NemotronHConfig's defaults (head_dim 128, 8 KV heads, Mamba-2 of 128 heads of 64 in 8 groups, d_state 128, MLP
    21504 wide) on blocks with a mixer after a mixer and MLPs in a row: the manifest's layers and sizes, and its
    parameter count transformers' (a model on the meta device)."""
    from transformers import AutoModelForCausalLM, NemotronHConfig

    from llmc.compiler.hf_checkpoint import model_config_from_hf
    from llmc.runtime.models import nemotron_h

    hf_config = NemotronHConfig(hybrid_override_pattern="M-MM*--M-*-")
    model = model_config_from_hf({**hf_config.to_dict(), "architectures": ["NemotronHForCausalLM"]}, nemotron_h.SPEC,
                                 "bfloat16")
    assert (model.num_layers, model.mamba_layers, model.kv_layers, model.no_mixer_layers, model.head_dim,
            model.num_kv_heads, model.mamba_num_heads, model.mamba_head_dim, model.mamba_n_groups, model.mamba_d_state,
            model.intermediate_size, model.rms_norm_eps) == (
        11, [0, 2, 3, 7], [4, 9], [1, 5, 6, 8, 10], 128, 8, 128, 64, 8, 128, 21504, 1e-5)
    with torch.device("meta"):
        assert model.num_parameters == AutoModelForCausalLM.from_config(hf_config).num_parameters()


def test_what_nemotron_h_refuses(checkpoint, artifact, tmp_path):
    """Refused by name as every hybrid model: prefix caching asked for, speculative decoding, LoRA, multi-step; at
    build an ONNX target, tensor parallel, int8; Nemotron-H's: no attention block, biases, MLP widths per
    block, a sliding window, another activation, a time_step_limit; `llmc export`."""
    refused = check_hybrid_refusals(checkpoint, artifact, tmp_path, "NemotronHForCausalLM")
    refused(CheckpointError, "no full_attention .* block .* is not supported",
            layers_block_type=["linear_attention", "mlp"] * 3)
    for key in ("attention_bias", "mlp_bias", "use_bias", "mamba_proj_bias"):
        refused(CheckpointError, f"{key}: true is not supported for Nemotron-H", **{key: True})
    refused(CheckpointError, "intermediate_size .96, 128.: MLP blocks of different widths", intermediate_size=[96, 128])
    refused(CheckpointError, "sliding_window 8: .* set it null", sliding_window=8)
    refused(CheckpointError, "mlp_hidden_act 'silu', .* relu2 MLPs and silu Mamba-2 convs only", mlp_hidden_act="silu")
    refused(CheckpointError, "time_step_limit .* is not supported", time_step_limit=[0.001, 10.0])
    refused(CheckpointError, "hybrid_override_pattern 'M-X': Nemotron-H's blocks", layers_block_type=None,
            hybrid_override_pattern="M-X")
    with pytest.raises(ArtifactError, match="cannot export architecture NemotronHForCausalLM: a hybrid model"):
        export_artifact(artifact, tmp_path / "export")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_on_the_gpu(checkpoint, artifact, hf_logits, hf_greedy, hf_encode, free_gpu):
    """As Granite 4.0's hybrid (test_granite4_hybrid.check_on_the_gpu: CUDA graphs of decode steps and eager against
    the CPU path and transformers), the relu2 MLPs in torch ops."""
    from transformers.models.nemotron_h import modeling_nemotron_h as hf_nemotron_h

    gated_norm = getattr(hf_nemotron_h, "NemotronHRMSNormGated", None) or hf_nemotron_h.Zamba2RMSNormGated
    check_on_the_gpu(checkpoint, artifact, hf_logits, hf_greedy, hf_encode, gated_norm)


def test_the_gpu_memory_profile_runs_the_hybrid(checkpoint, artifact, monkeypatch, hf_logits):
    check_memory_profile_forward(checkpoint, artifact, monkeypatch, hf_logits)
