"""LFM2 (Lfm2ForCausalLM) against transformers' own model (float32) on a tiny random checkpoint whose layer_types are
[conv, full_attention, conv] (a short conv of 3 taps; GQA 4/2 with q/k norms; the feed-forward derived 128 wide):
logits at every position of a prefill in chunks of 16 (each conv layer's state carried across chunks in its slot),
greedy tokens and logprobs of prompts batched on fewer seats than prompts, also with the attention on its Triton kernels
(interpreted) and with decode steps through a decode graph's static buffers (padding rows on the scratch slot); greedy
tokens under preemption by recompute (a tiny KV cache) and in chunks of 5; n = 2 and an abort mid-stream (the request
that takes the slot next starts from zero state) (Qwen3.5's tests on this model); RTN and GPTQ W4 builds (in_proj and
out_proj quantized, the conv dense) against transformers holding their dequantized weights; the feed-forward's width
and the parameter count of published-style configs; the refusals; -m gpu: CUDA (written, not run here) (LFM2-MoE:
tests/runtime/test_lfm2_moe.py)."""

import dataclasses
import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (triton reads it then)

import pytest
import torch

from llmc.cli_report import _attention_text
from llmc.compiler.export import export_artifact
from llmc.errors import ArtifactError, CheckpointError
from llmc.runtime.artifact import FORMAT_VERSION, read_manifest
from llmc.runtime.llm import LLM
from tests.runtime.hf_oracle import check_quantized_build, hybrid_quantization
from tests.runtime.hf_oracle import family_fixtures
from tests.runtime.test_glm4_moe import PROMPTS, _check
from tests.runtime.test_glm4_moe import triton_dispatch  # noqa: F401 (a fixture)
from tests.runtime.test_qwen3_5 import check_hybrid_refusals, check_memory_profile_forward
from tests.runtime.test_qwen3_5 import test_decodes_through_the_graphs_static_buffers as qwen_static_decodes
from tests.runtime.test_qwen3_5 import test_n_above_1_and_an_abort_mid_stream as qwen_abort
from tests.runtime.test_qwen3_5 import test_preemption_and_short_chunks_keep_transformers_tokens as qwen_preemption
from tests.runtime.test_qwen3_5 import test_the_triton_path_matches_transformers as qwen_triton
from tests.runtime.test_qwen3_5 import PREEMPTION_CASES


checkpoint, artifact = family_fixtures("lfm2", "lfm2")


@torch.inference_mode()
def test_logits_greedy_and_logprobs_match_transformers(checkpoint, artifact, hf_logits, hf_greedy, hf_encode):
    """Logits over 40 positions prefilled in chunks of 16 (1e-4), greedy tokens of 3 prompts on 2 seats and their
    logprobs as transformers'; the manifest's conv layers, kernel, feed-forward width, norm eps (and what `llmc
    inspect` says of them); one KV cache (the attention layer's); a conv state [hidden, 2] per slot."""
    manifest = read_manifest(artifact)
    m = manifest.model
    assert manifest.format_version == FORMAT_VERSION == "1.47"
    assert (m.family, m.short_conv_layers, m.short_conv_kernel, m.kv_layers, m.intermediate_size, m.qk_norm,
            m.rms_norm_eps) == ("lfm2", [0, 2], 3, [1], 128, True, 1e-5)
    assert "gated short conv of 3 taps on 2 of 3 layers" in _attention_text(dataclasses.asdict(m))  # (llmc inspect)
    with LLM(artifact, device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        _check(llm, checkpoint, hf_logits, hf_greedy, hf_encode)
        runner = llm.engine.runner
        assert len(runner.kv_caches) == 1
        assert runner.model.layers["2"].attn.conv_state.shape == (3, 64, 2)  # max_num_seqs + 1 slots
        assert not llm.engine.options.enable_prefix_caching


def test_the_triton_path_matches_transformers(checkpoint, artifact, triton_dispatch, hf_logits, hf_greedy,  # noqa: F811
                                              hf_encode):
    """Qwen3.5's test on this model: the attention layer's rotary + KV write and paged attention on their Triton kernels
    (the interpreter on CPU tensors), the conv layers' short conv on its kernel: transformers' logits, greedy tokens,
    logprobs."""
    qwen_triton(checkpoint, artifact, triton_dispatch, hf_logits, hf_greedy, hf_encode)


def test_decodes_through_the_graphs_static_buffers(checkpoint, artifact, hf_logits, hf_greedy, hf_encode):
    """Qwen3.5's test on this model: decode steps padded to 4 rows whose padding rows write the scratch state slot
    (what a decode graph replays, on the CPU), also with the first request finishing first: transformers' greedy
    tokens and logprobs."""
    qwen_static_decodes(checkpoint, artifact, hf_logits, hf_greedy, hf_encode)


@PREEMPTION_CASES
def test_preemption_and_short_chunks_keep_transformers_tokens(options, checkpoint, artifact, hf_encode):
    """Qwen3.5's test on this model: with 5 KV blocks requests are preempted and prefilled again from zero state; in
    chunks of 5 each chunk's conv reads the chunk before's last 2 rows of B x from the conv state: transformers'
    greedy tokens, no block or row left held."""
    qwen_preemption(options, checkpoint, artifact, hf_encode)


def test_n_above_1_and_an_abort_mid_stream(checkpoint, artifact, hf_encode):
    """Qwen3.5's test on this model: n = 2 samples of top_k 1 both transformers' greedy tokens; a request aborted
    after 3 tokens gives its slot back at once and the request that takes it next starts from zero state."""
    qwen_abort(checkpoint, artifact, hf_encode)


@torch.inference_mode()
@pytest.mark.parametrize("method", ["rtn", "gptq", pytest.param("fp8", marks=pytest.mark.slow)])
def test_a_w4_build_runs_transformers_on_its_weights(method, checkpoint, tmp_path, data_dir, hf_encode):
    """RTN and GPTQ (calibrated through the conv layers from zero state) W4 of every linear (the conv layers' in_proj
    and out_proj, the attention's qkv and out_proj, the feed-forwards) against transformers holding its dequantized
    weights (the conv's weight and the norms dense). FP8 W8A8 of the linears too (hf_oracle.hybrid_quantization), each
    FP8 input rounded in transformers as the scheme rounds it."""
    quantization, fmt, check = hybrid_quantization(method)
    check_quantized_build(checkpoint, tmp_path, data_dir, hf_encode, quantization, PROMPTS, **check)
    modules = read_manifest(tmp_path / "q").quant.modules
    assert {modules[f"layers.{i}.{name}"]["format"] for i, name in
            [(0, "attn.conv_in"), (2, "attn.conv_out"), (1, "attn.qkv"), (1, "attn.o"), (0, "mlp.gate_up")]} == {fmt}
    assert "layers.0.attn.qkv" not in modules and "layers.1.attn.conv_in" not in modules


@pytest.mark.parametrize("keys", [
    {"block_ff_dim": 1536, "full_attn_idxs": [1, 3], "tie_embedding": True, "block_dim": 256, "conv_dim": 256,
     "conv_dim_out": 256, "use_pos_enc": True, "theta": 1e6},  # LFM2-1.2B's spelling (1024 wide), keys it ignores
    {"intermediate_size": 1000, "block_ffn_dim_multiplier": 1.25, "block_multiple_of": 100,  # 666 -> 832 -> 900
     "layer_types": ["conv", "full_attention"] * 2, "rope_theta": 5e5},
    {"intermediate_size": 700, "block_auto_adjust_ff_dim": False, "layer_types": ["full_attention", "conv"] * 2,
     "tie_word_embeddings": False}], ids=["published-keys", "multiplier", "not-adjusted"])
def test_configs_read_as_transformers_reads_them(keys):
    """Configs as published (block_ff_dim, full_attn_idxs, tie_embedding, keys transformers ignores), with another
    multiplier and rope_theta, without the width's adjustments: the feed-forward's width, the conv layers, the tied
    head, the rotary base (LFM2's default 1e6) and the parameter count transformers' (a model on the meta device)."""
    from transformers import AutoModelForCausalLM, Lfm2Config

    from llmc.compiler.hf_checkpoint import model_config_from_hf
    from llmc.runtime.models import lfm2

    config = {"architectures": ["Lfm2ForCausalLM"], "model_type": "lfm2", "vocab_size": 1000, "hidden_size": 256,
              "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, **keys}
    model = model_config_from_hf(config, lfm2.SPEC, "bfloat16")
    hf_config = Lfm2Config(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(hf_config)
    attention = [i for i, kind in enumerate(hf_config.layer_types) if kind == "full_attention"]
    assert model.intermediate_size == hf.model.layers[0].feed_forward.w1.out_features
    assert (model.kv_layers, model.short_conv_kernel, model.tie_word_embeddings, model.rope_theta) == (
        attention, 3, hf_config.tie_word_embeddings, hf_config.rope_parameters["rope_theta"])
    assert model.num_parameters == hf.num_parameters()


def test_what_lfm2_refuses(checkpoint, artifact, tmp_path):
    """Refused by name as Qwen3.5's hybrids: prefix caching asked for, speculative decoding, LoRA, multi-step; at build
    an ONNX target, tensor parallel, int8, an import (FP8 imports: Qwen3.5's alone); LFM2's conv biases, every layer
    conv, another layer kind; LFM2-VL checkpoints; `llmc export`."""
    refused = check_hybrid_refusals(checkpoint, artifact, tmp_path, "Lfm2ForCausalLM")
    refused(CheckpointError, "conv_bias: true is not supported", conv_bias=True)
    refused(CheckpointError, "every layer conv .* is not supported", layer_types=["conv"] * 3)
    refused(CheckpointError, "one of conv or full_attention per layer",
            layer_types=["conv", "sliding_attention", "conv"])
    refused(CheckpointError, "Lfm2VlForConditionalGeneration: LFM2-VL .* is not supported",
            architectures=["Lfm2VlForConditionalGeneration"])
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
    refused(CheckpointError, "import is not supported for Lfm2ForCausalLM .* from a quantized checkpoint \\(tested: "
            "Qwen3.5's", recipe={"quantization": {"method": "import"}}, quantization_config=fp8)
    with pytest.raises(ArtifactError, match="cannot export architecture Lfm2ForCausalLM: a hybrid model"):
        export_artifact(artifact, tmp_path / "export")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_on_the_gpu(checkpoint, artifact, hf_logits, hf_greedy, hf_encode, free_gpu):
    """The float32 artifact on CUDA (Triton attention in the attention layer, the short convs on their Triton kernel;
    decode steps replay CUDA graphs that read the state slots), and with enforce_eager: transformers' logits (2e-3),
    greedy tokens and logprobs."""
    check_on_the_gpu(checkpoint, artifact, hf_logits, hf_greedy, hf_encode)


def check_on_the_gpu(checkpoint, artifact, hf_logits, hf_greedy, hf_encode):
    """test_on_the_gpu's checks of `artifact` (LFM2-MoE's test runs them too)."""
    for eager in (False, True):
        with LLM(artifact, device="cuda", gpu_memory_utilization=0.3, max_num_seqs=3, max_num_batched_tokens=16,
                 enforce_eager=eager) as llm:
            runner = llm.engine.runner
            _check(llm, checkpoint, hf_logits, hf_greedy, hf_encode, tolerance=2e-3)
            assert eager or runner.graphs.num_replays > 0


def test_the_gpu_memory_profile_runs_the_hybrid(checkpoint, artifact, monkeypatch, hf_logits):
    check_memory_profile_forward(checkpoint, artifact, monkeypatch, hf_logits)
