"""Granite 4.0's hybrids (GraniteMoeHybridForCausalLM with Mamba-2 layers: granite-4.0-h-*) against transformers' own
model (float32) on a tiny random checkpoint whose layer_types are [mamba, attention, mamba] (Mamba-2 of 8 heads of 16
in 2 groups, d_state 16, a conv of 4, chunks of 8; NoPE, Granite's multipliers): logits at every position of a prefill
in chunks of 16 (each Mamba-2 layer's conv and SSM state carried across chunks in its slot), greedy tokens and
logprobs of prompts batched on fewer seats than prompts, also with the attention on its Triton kernels (interpreted)
and with decode steps through a decode graph's static buffers (padding rows on the scratch slot); greedy tokens under
preemption by recompute (a tiny KV cache) and in chunks of 5; an abort mid-stream gives its slot back (the request
that takes it next starts from zero state); RTN and GPTQ W4 builds (in_proj and out_proj quantized, the rest dense)
against transformers holding their dequantized weights; the parameter count of GraniteMoeHybridConfig's defaults; the
refusals (every layer Mamba-2 among them: a model without an attention layer is not run); -m gpu: CUDA (written, not
run here)."""

import inspect
import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (triton reads it then)

import pytest
import torch

from llmc.compiler.export import export_artifact
from llmc.errors import ArtifactError, CheckpointError
from llmc.runtime.artifact import FORMAT_VERSION, read_manifest
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from tests.runtime.hf_oracle import check_quantized_build, hybrid_quantization
from tests.runtime.hf_oracle import family_fixtures
from tests.runtime.test_glm4_moe import PROMPTS, _check
from tests.runtime.test_glm4_moe import triton_dispatch  # noqa: F401 (a fixture)
from tests.runtime.test_qwen3_5 import _hf_tokens, check_hybrid_refusals, check_memory_profile_forward
from tests.runtime.test_qwen3_5 import test_decodes_through_the_graphs_static_buffers as qwen_static_decodes
from tests.runtime.test_qwen3_5 import test_n_above_1_and_an_abort_mid_stream as qwen_abort
from tests.runtime.test_qwen3_5 import test_the_triton_path_matches_transformers as qwen_triton
from tests.runtime.test_qwen3_5 import PREEMPTION_CASES

MAMBA = {"layer_types": ["mamba", "attention", "mamba"], "position_embedding_type": "nope", "mamba_n_heads": 8,
         "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 8}


checkpoint, artifact = family_fixtures("granite4_hybrid", "granitemoehybrid", **MAMBA)


@torch.inference_mode()
def test_logits_greedy_and_logprobs_match_transformers(checkpoint, artifact, hf_logits, hf_greedy, hf_encode):
    """Logits over 40 positions prefilled in chunks of 16 (1e-4), greedy tokens of 3 prompts on 2 seats and their
    logprobs as transformers'; the manifest's Mamba-2 layers and sizes; one KV cache (the attention layer's)."""
    manifest = read_manifest(artifact)
    m = manifest.model
    assert manifest.format_version == FORMAT_VERSION == "1.47"
    assert (m.mamba_layers, m.mamba_num_heads, m.mamba_head_dim, m.mamba_n_groups, m.mamba_d_state,
            m.mamba_conv_kernel, m.mamba_chunk_size, m.mamba_conv_bias, m.kv_layers) == (
        [0, 2], 8, 16, 2, 16, 4, 8, True, [1])
    with LLM(artifact, device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        _check(llm, checkpoint, hf_logits, hf_greedy, hf_encode)
        runner = llm.engine.runner
        assert len(runner.kv_caches) == 1
        assert runner.model.layers["0"].attn.ssm_state.shape == (3, 8, 16, 16)  # max_num_seqs + 1 slots
        assert runner.model.layers["2"].attn.conv_state.shape == (3, 128 + 2 * 2 * 16, 3)
        assert not llm.engine.options.enable_prefix_caching



def test_the_triton_path_matches_transformers(checkpoint, artifact, triton_dispatch, hf_logits, hf_greedy,  # noqa: F811
                                              hf_encode):
    """Qwen3.5's test on this model: the attention layer's rotary + KV write and paged attention on their Triton kernels
    (the interpreter on CPU tensors), the Mamba-2 layers' conv and SSD recurrence on theirs: transformers' logits,
    greedy tokens, logprobs."""
    qwen_triton(checkpoint, artifact, triton_dispatch, hf_logits, hf_greedy, hf_encode)


def test_decodes_through_the_graphs_static_buffers(checkpoint, artifact, hf_logits, hf_greedy, hf_encode):
    """Qwen3.5's test on this model: what a decode graph replays (runtime/cuda_graphs.py), on the CPU: decode steps
    padded to 4 rows whose padding rows write the scratch state slot, also with the first request finishing first:
    transformers' greedy tokens and logprobs."""
    qwen_static_decodes(checkpoint, artifact, hf_logits, hf_greedy, hf_encode)


def test_the_default_config_reads_as_transformers():
    """GraniteMoeHybridConfig's defaults (mamba_d_head auto, the published "mamba" / "attention" spelling): the
    manifest's sizes, and its parameter count transformers' (a model on the meta device)."""
    from transformers import AutoModelForCausalLM, GraniteMoeHybridConfig

    from llmc.compiler.hf_checkpoint import model_config_from_hf
    from llmc.runtime.models import granitemoehybrid

    hf_config = GraniteMoeHybridConfig(num_hidden_layers=4, num_local_experts=0, shared_intermediate_size=512,
                                       hidden_size=256, mamba_n_heads=8, mamba_d_state=32,
                                       layer_types=["mamba", "mamba", "attention", "mamba"])
    config = {**hf_config.to_dict(), "architectures": ["GraniteMoeHybridForCausalLM"],
              "layer_types": ["mamba", "mamba", "attention", "mamba"]}
    model = model_config_from_hf(config, granitemoehybrid.SPEC, "bfloat16")
    assert (model.mamba_layers, model.kv_layers, model.mamba_head_dim, model.mamba_conv_kernel) == (
        [0, 1, 3], [2], 64, 4)
    with torch.device("meta"):
        assert model.num_parameters == AutoModelForCausalLM.from_config(hf_config).num_parameters()


@torch.inference_mode()
@PREEMPTION_CASES
def test_preemption_and_short_chunks_keep_transformers_tokens(options, checkpoint, artifact, hf_encode):
    """3 prompts on 3 seats with 5 KV blocks: requests are preempted and prefilled again from zero state; or chunks of
    5 tokens (each chunk's conv reads the chunk before's last 3 inputs from the conv state): transformers' greedy
    tokens, no block or row left held."""
    encoded = [hf_encode(checkpoint, p) for p in PROMPTS]
    from llmc.runtime.sampling_params import SamplingParams

    with LLM(artifact, device="cpu", max_num_seqs=3, **{"num_kv_blocks": 64, **options}) as llm:
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in encoded],
                               SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        stats = llm.stats()
        assert (stats["num_preemptions"] > 0) == ("num_kv_blocks" in options)
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        assert sorted(llm.engine._free_rows) == list(range(3))
    assert [o.outputs[0].token_ids for o in outputs] == [_hf_tokens(checkpoint, ids, 16) for ids in encoded]


def test_n_above_1_and_an_abort_mid_stream(checkpoint, artifact, hf_encode):
    """Qwen3.5's test on this model: n = 2 samples of top_k 1 both transformers' greedy tokens; a request aborted
    after 3 tokens gives its slot back at once and the request that takes it next starts from zero state."""
    qwen_abort(checkpoint, artifact, hf_encode)


@torch.inference_mode()
@pytest.mark.parametrize("method", ["rtn", "gptq", "fp8"])
def test_a_w4_build_runs_transformers_on_its_weights(method, checkpoint, tmp_path, data_dir, hf_encode):
    """RTN and GPTQ (calibrated through the Mamba-2 layers from zero state) W4 of every linear (the Mamba-2 layers'
    in_proj and out_proj, the attention's qkv and o, the MLPs) against transformers holding its dequantized weights (the
    conv, dt_bias, A_log, D and the gated norm dense). FP8 W8A8 of the linears too (hf_oracle.hybrid_quantization), each
    FP8 input rounded in transformers as the scheme rounds it."""
    quantization, fmt, check = hybrid_quantization(method)
    check_quantized_build(checkpoint, tmp_path, data_dir, hf_encode, quantization, PROMPTS, **check)
    modules = read_manifest(tmp_path / "q").quant.modules
    assert {modules[f"layers.{i}.{name}"]["format"] for i, name in
            [(0, "attn.mamba_in"), (2, "attn.mamba_out"), (1, "attn.qkv"), (0, "mlp.gate_up")]} == {fmt}
    assert "layers.0.attn.qkv" not in modules


def test_what_a_granite4_hybrid_refuses(checkpoint, artifact, tmp_path):
    """Refused by name as Qwen3.5's hybrids: prefix caching asked for, speculative decoding, LoRA, multi-step; at build
    an ONNX target, tensor parallel, int8; Granite 4.0's no attention layer, mamba_proj_bias, a time_step_limit,
    another hidden_act; `llmc export`."""
    refused = check_hybrid_refusals(checkpoint, artifact, tmp_path, "GraniteMoeHybridForCausalLM")
    refused(CheckpointError, "layer_types None: every layer Mamba-2 .* is not supported", layer_types=None)
    refused(CheckpointError, "mamba_proj_bias: true is not supported", mamba_proj_bias=True)
    refused(CheckpointError, "time_step_limit .* is not supported", time_step_limit=[0.0, 10.0])
    refused(CheckpointError, "hidden_act 'gelu' is not supported", hidden_act="gelu")
    with pytest.raises(ArtifactError, match="cannot export architecture GraniteMoeHybridForCausalLM: a hybrid model"):
        export_artifact(artifact, tmp_path / "export")


def check_on_the_gpu(checkpoint, artifact, hf_logits, hf_greedy, hf_encode, gated_norm, check_runner=None):
    """The float32 artifact on CUDA (Triton attention in the attention layers, the Mamba-2 mixer's conv, SSD
    recurrence and gated norm on their Triton kernels; decode steps replay CUDA graphs that read the state slots),
    and with enforce_eager: the CPU path's logits (2e-3; the CPU path holds transformers' to 1e-4) and greedy tokens
    of prompts finishing at different steps; and transformers' where its gated RMSNorm (`gated_norm`, the model's
    class) is per group (transformers 5.17, on the session-50 device, normalises Granite 4.0's and Bamba's whole
    width: 3.5 off with the test checkpoints' 2 groups). `check_runner(runner)`: what else to assert of the CUDA
    runner."""
    token_ids = hf_encode(checkpoint, PROMPTS[1]) + list(range(100, 126))
    prompts = [{"prompt_token_ids": hf_encode(checkpoint, p)} for p in PROMPTS]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 12, 8)]
    with LLM(artifact, device="cpu", max_num_seqs=3, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        cpu_logits = llm.engine.score(token_ids)
        cpu_tokens = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    per_group = "group_size" in inspect.signature(gated_norm).parameters
    for eager in (False, True):
        with LLM(artifact, device="cuda", gpu_memory_utilization=0.3, max_num_seqs=3, max_num_batched_tokens=16,
                 enforce_eager=eager) as llm:
            runner = llm.engine.runner
            if check_runner is not None:
                check_runner(runner)
            torch.testing.assert_close(llm.engine.score(token_ids).cpu(), cpu_logits, atol=2e-3, rtol=2e-3)
            assert [out.outputs[0].token_ids for out in llm.generate(prompts, params)] == cpu_tokens
            if per_group:
                _check(llm, checkpoint, hf_logits, hf_greedy, hf_encode, tolerance=2e-3)
            assert eager or runner.graphs.num_replays > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_on_the_gpu(checkpoint, artifact, hf_logits, hf_greedy, hf_encode, free_gpu):
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridRMSNormGated

    check_on_the_gpu(checkpoint, artifact, hf_logits, hf_greedy, hf_encode, GraniteMoeHybridRMSNormGated)


def test_the_gpu_memory_profile_runs_the_hybrid(checkpoint, artifact, monkeypatch, hf_logits):
    check_memory_profile_forward(checkpoint, artifact, monkeypatch, hf_logits)
