"""OLMo Hybrid (OlmoHybridForCausalLM) against transformers' own model (float32) on a tiny random checkpoint whose
layer_types are [linear, linear, full, linear] (Qwen3.5's sizes; the full layer OLMo 3's, without rotary as the
published checkpoints: rope_theta null), written by save_pretrained in OLMo-core's names (attention_layer_norm,
feedforward_layer_norm, q/k/v_conv1d): logits at every position of a prefill in chunks of 16, greedy tokens and logprobs
of prompts batched on fewer seats than prompts, also with the attention on its Triton kernels (interpreted) and with
decode steps through a decode graph's static buffers; greedy tokens under preemption by recompute (a tiny KV cache) and
in chunks of 5; n = 2 and an abort mid-stream (Qwen3.5's tests on this model); a rotary copy; the same checkpoint in
transformers' names; each DeltaNet layer's switches (beta times 2 or not, the gated norm's own eps) against
transformers' decoder layer; RTN and GPTQ (-m slow) W4 builds against transformers holding their dequantized
weights; the default config's parameter count; the refusals; the GPU memory profile's forward; -m gpu: CUDA (written,
not run here)."""

import dataclasses
import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (triton reads it then)

import pytest
import torch

from llmc.cli_report import _attention_text
from llmc.compiler.export import export_artifact
from llmc.errors import ArtifactError, CheckpointError, RequestError
from llmc.runtime.artifact import FORMAT_VERSION, read_manifest
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from tests.conftest import make_hf_checkpoint
from tests.runtime.hf_oracle import build_float32, check_quantized_build, hybrid_quantization
from tests.runtime.hf_oracle import family_fixtures
from tests.runtime.test_glm4_moe import PROMPTS, _check
from tests.runtime.test_glm4_moe import triton_dispatch  # noqa: F401 (a fixture)
from tests.runtime.test_qwen3_5 import check_hybrid_refusals, check_memory_profile_forward
from tests.runtime.test_qwen3_5 import test_decodes_through_the_graphs_static_buffers as qwen_static_decodes
from tests.runtime.test_qwen3_5 import test_n_above_1_and_an_abort_mid_stream as qwen_abort
from tests.runtime.test_qwen3_5 import test_preemption_and_short_chunks_keep_transformers_tokens as qwen_preemption
from tests.runtime.test_qwen3_5 import test_the_triton_path_matches_transformers as qwen_triton
from tests.runtime.test_qwen3_5 import PREEMPTION_CASES


checkpoint, artifact = family_fixtures("olmo_hybrid", "olmo_hybrid")


@torch.inference_mode()
def test_logits_greedy_and_logprobs_match_transformers(checkpoint, artifact, hf_logits, hf_greedy, hf_encode):
    """Logits over 40 positions prefilled in chunks of 16 (1e-4), greedy tokens of 3 prompts on 2 seats and their
    logprobs as transformers'; the manifest's DeltaNet layers (Llama's norms in them), beta's factor, the gated norm's
    eps, no rotary, no output gate (and what `llmc inspect` says of them); one KV cache (the full layer's)."""
    from safetensors import safe_open

    with safe_open(checkpoint / "model.safetensors", "pt") as f:  # (save_pretrained writes OLMo-core's names)
        assert {"model.layers.0.attention_layer_norm.weight", "model.layers.0.linear_attn.q_conv1d.weight"} <= set(
            f.keys())
    manifest = read_manifest(artifact)
    m = manifest.model
    assert manifest.format_version == FORMAT_VERSION == "1.47"
    assert (m.family, m.linear_attention_layers, m.pre_norm_layers, m.pre_norms, m.sandwich_norms,
            m.qk_norm_full_width, m.linear_allow_neg_eigval, m.linear_norm_eps, m.rope_on_full_layers,
            m.attn_output_gate, m.kv_layers) == (
        "olmo_hybrid", [0, 1, 3], [0, 1, 3], False, True, True, True, 1e-5, False, False, [2])
    text = _attention_text(dataclasses.asdict(m))  # (llmc inspect)
    assert "Gated DeltaNet on 3 of 4 layers (a state per request, no KV, beta up to 2), attention on the others" in text
    with LLM(artifact, device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        _check(llm, checkpoint, hf_logits, hf_greedy, hf_encode)
        runner = llm.engine.runner
        assert len(runner.kv_caches) == 1
        assert runner.model.layers["0"].attn.recurrent_state.shape == (3, 4, 16, 16)  # max_num_seqs + 1 slots
        assert hasattr(runner.model.layers["0"], "input_norm") and not hasattr(runner.model.layers["2"], "input_norm")


def test_the_triton_path_matches_transformers(checkpoint, artifact, triton_dispatch, hf_logits, hf_greedy,  # noqa: F811
                                              hf_encode):
    """Qwen3.5's test on this model: the full layer's rotary (by nothing) + KV write and paged attention on their Triton
    kernels (the interpreter on CPU tensors), the DeltaNets' conv and delta rule on theirs: transformers' logits, greedy
    tokens, logprobs."""
    qwen_triton(checkpoint, artifact, triton_dispatch, hf_logits, hf_greedy, hf_encode)


def test_decodes_through_the_graphs_static_buffers(checkpoint, artifact, hf_logits, hf_greedy, hf_encode):
    """Qwen3.5's test on this model: decode steps padded to 4 rows whose padding rows write the scratch state slot
    (what a decode graph replays, on the CPU), also with the first request finishing first: transformers' greedy
    tokens and logprobs."""
    qwen_static_decodes(checkpoint, artifact, hf_logits, hf_greedy, hf_encode)


@PREEMPTION_CASES
def test_preemption_and_short_chunks_keep_transformers_tokens(options, checkpoint, artifact, hf_encode):
    """Qwen3.5's test on this model: with 5 KV blocks requests are preempted and prefilled again from zero state; in
    chunks of 5 each chunk's conv reads the chunk before's last 3 inputs from the conv state: transformers' greedy
    tokens, no block or row left held."""
    qwen_preemption(options, checkpoint, artifact, hf_encode)


def test_n_above_1_and_an_abort_mid_stream(checkpoint, artifact, hf_encode):
    """Qwen3.5's test on this model: n = 2 samples of top_k 1 both transformers' greedy tokens; a request aborted
    after 3 tokens gives its slot back at once and the request that takes it next starts from zero state."""
    qwen_abort(checkpoint, artifact, hf_encode)


@torch.inference_mode()
def test_a_rotary_checkpoint_and_transformers_names(checkpoint, tmp_path, hf_logits, hf_encode):
    """A copy with rope_theta 10000 (OlmoHybridModel then rotates the full layers' q and k): transformers' logits over
    34 positions (1e-4), the manifest's rotary on; the checkpoint stored in transformers' own names (input_layernorm,
    post_attention_layernorm, one conv1d) builds the same tensors as in OLMo-core's."""
    from safetensors.torch import load_file, save_file

    from tests.conftest import TOKENIZER_FILES, hf_model

    rotary = make_hf_checkpoint(tmp_path / "rope", "olmo_hybrid", rope_theta=10000.0)
    built = build_float32(rotary, tmp_path / "a")
    assert read_manifest(built).model.rope_on_full_layers
    token_ids = hf_encode(rotary, PROMPTS[1]) + list(range(100, 120))
    with LLM(built, device="cpu", max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        torch.testing.assert_close(llm.engine.score(token_ids), hf_logits(rotary, token_ids), atol=1e-4, rtol=1e-4)
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for name in [*TOKENIZER_FILES, "config.json", "generation_config.json"]:
        (renamed / name).write_bytes((checkpoint / name).read_bytes())
    state = {k: v.contiguous() for k, v in hf_model(checkpoint).state_dict().items()}
    assert "model.layers.0.linear_attn.conv1d.weight" in state
    save_file(state, renamed / "model.safetensors", metadata={"format": "pt"})
    again = build_float32(renamed, tmp_path / "b")
    want = load_file(build_float32(checkpoint, tmp_path / "c") / "rank-00" / "weights.safetensors")
    got = load_file(again / "rank-00" / "weights.safetensors")
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, atol=0, rtol=0, msg=name)


@torch.inference_mode()
@pytest.mark.parametrize("changes", [{}, {"linear_allow_neg_eigval": False, "rms_norm_eps": 0.1}],
                         ids=["beta-x2", "beta-x1-eps-0.1"])
def test_a_deltanet_layer_is_transformers(changes, checkpoint, tmp_path):
    """A DeltaNet layer (input_norm, the DeltaNet, post_attn_norm, the MLP) run as GPTQ's calibration runs it (two
    windows of 32 tokens from zero state) against transformers' OlmoHybridLinearAttentionDecoderLayer: with beta times
    2 (the default) and without, with the gated norm's eps 1e-5 beside an rms_norm_eps of 0.1 (1e-4); the same layer
    with a switch the checkpoint does not ask for (beta's factor flipped, or the gated norm on rms_norm_eps) is not."""
    from llmc.compiler.calibration import LayerRunner
    from llmc.compiler.convert import read_layer
    from llmc.compiler.hf_checkpoint import TensorReader, model_config_from_hf, olmo_hybrid_tensors, read_hf_config
    from llmc.runtime.models import olmo_hybrid
    from tests.conftest import hf_model

    source = make_hf_checkpoint(tmp_path / "ckpt", "olmo_hybrid", **changes) if changes else checkpoint
    spec = olmo_hybrid.SPEC
    config = model_config_from_hf(read_hf_config(source), spec, "float32")
    assert (config.linear_allow_neg_eigval, config.rms_norm_eps) == (
        changes.get("linear_allow_neg_eigval", True), changes.get("rms_norm_eps", 1e-6))
    hidden = torch.randn(2, 32, 64, generator=torch.Generator().manual_seed(3))
    want = hf_model(source).model.layers[1](hidden, position_embeddings=None)
    wrong = [dataclasses.replace(config, linear_allow_neg_eigval=not config.linear_allow_neg_eigval)]
    if changes:
        wrong.append(dataclasses.replace(config, linear_norm_eps=None))
    for layer_config, matches in [(config, True)] + [(c, False) for c in wrong]:
        runner = LayerRunner(layer_config, 32, torch.device("cpu"))
        with TensorReader(source) as stored:
            derived = olmo_hybrid_tensors(spec, layer_config, set(stored.names()))
        with TensorReader(source, derived=derived) as reader:
            module = runner.build_layer(read_layer(reader, spec, layer_config, 1))
        got = runner.forward(module, hidden)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4) == matches, (layer_config, (got - want).abs().max())


@torch.inference_mode()
@pytest.mark.parametrize("method", ["rtn",
                                    *(pytest.param(m, marks=pytest.mark.slow) for m in ("gptq", "fp8"))])
def test_a_w4_build_runs_transformers_on_its_weights(method, checkpoint, tmp_path, data_dir, hf_encode):
    """RTN and GPTQ (-m slow; calibrated through the DeltaNet layers: test_a_deltanet_layer_is_transformers) W4 of every
    linear (the full layer's qkv and o, the DeltaNets' in_qkvz (q, k, v, g) and out, the MLPs, lm_head; in_ba, the conv,
    A_log, dt_bias, the norms dense) against transformers holding its dequantized weights: logits (1e-4) and 16 greedy
    tokens. FP8 W8A8 of the linears too (hf_oracle.hybrid_quantization), each FP8 input rounded in transformers as the
    scheme rounds it."""
    quantization, fmt, check = hybrid_quantization(method)
    check_quantized_build(checkpoint, tmp_path, data_dir, hf_encode, quantization, PROMPTS, **check)
    modules = read_manifest(tmp_path / "q").quant.modules
    assert {modules[f"layers.{i}.{name}"]["format"] for i, name in
            [(0, "attn.in_qkvz"), (0, "attn.out"), (2, "attn.qkv"), (2, "attn.o"), (3, "mlp.gate_up")]} == {fmt}
    assert "layers.0.attn.qkv" not in modules and "layers.2.attn.in_qkvz" not in modules


def test_the_default_config_reads_as_transformers():
    """OlmoHybridConfig's defaults (Olmo-Hybrid-7B's sizes; layer_types filled in: every fourth layer full attention;
    the DeltaNet's 30 heads of 96 / 192 from hidden_size) read as transformers reads them, with its parameter count
    (a model on the meta device)."""
    from transformers import AutoModelForCausalLM, OlmoHybridConfig

    from llmc.compiler.hf_checkpoint import model_config_from_hf
    from llmc.runtime.models import olmo_hybrid

    hf_config = OlmoHybridConfig(num_hidden_layers=8, vocab_size=100352)
    config = {**hf_config.to_dict(), "architectures": ["OlmoHybridForCausalLM"]}
    config.pop("layer_types")
    model = model_config_from_hf(config, olmo_hybrid.SPEC, "bfloat16")
    assert (model.linear_attention_layers, model.kv_layers, model.linear_num_value_heads, model.linear_key_head_dim,
            model.linear_value_head_dim, model.rope_on_full_layers) == ([0, 1, 2, 4, 5, 6], [3, 7], 30, 96, 192, True)
    with torch.device("meta"):
        assert model.num_parameters == AutoModelForCausalLM.from_config(hf_config).num_parameters()


def test_what_olmo_hybrid_refuses(checkpoint, artifact, tmp_path):
    """Refused by name as Qwen3.5's hybrids: prefix caching asked for, speculative decoding, LoRA, multi-step, beam
    search; at build an ONNX target, tensor parallel, int8; attention_bias, a hidden_act other than SiLU, another layer
    kind; `llmc export`."""
    refused = check_hybrid_refusals(checkpoint, artifact, tmp_path, "OlmoHybridForCausalLM")
    refused(CheckpointError, "attention_bias: true is not supported", attention_bias=True)
    refused(CheckpointError, "hidden_act 'gelu' is not supported", hidden_act="gelu")  # (the MLP's and the conv's)
    refused(CheckpointError, "layer_types .*: one of linear_attention or full_attention",
            layer_types=["linear_attention", "sliding_attention", "full_attention", "linear_attention"])
    with LLM(artifact, device="cpu", num_kv_blocks=64) as llm:
        with pytest.raises(RequestError, match="use_beam_search: not supported for OlmoHybridForCausalLM"):
            llm.engine.add_request(None, SamplingParams(use_beam_search=True, n=2, max_tokens=4),
                                   prompt_token_ids=[5, 6, 7])
    with pytest.raises(ArtifactError, match="cannot export architecture OlmoHybridForCausalLM: a hybrid model"):
        export_artifact(artifact, tmp_path / "export")


def test_the_gpu_memory_profile_runs_the_hybrid(checkpoint, artifact, monkeypatch, hf_logits):
    check_memory_profile_forward(checkpoint, artifact, monkeypatch, hf_logits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_on_the_gpu(checkpoint, artifact, hf_logits, hf_greedy, hf_encode, free_gpu):
    """The float32 artifact on CUDA (Triton attention in the full layer, the DeltaNets' conv and delta rule on their
    Triton kernels; decode steps replay CUDA graphs that read the state slots), and with enforce_eager: the CPU path's
    logits (2e-3) and greedy tokens of prompts finishing at different steps (test_granite4_hybrid.check_on_the_gpu: the
    CPU path holds transformers' to 1e-4 above)."""
    from transformers.models.olmo_hybrid.modeling_olmo_hybrid import OlmoHybridRMSNormGated

    from tests.runtime.test_granite4_hybrid import check_on_the_gpu

    check_on_the_gpu(checkpoint, artifact, hf_logits, hf_greedy, hf_encode, OlmoHybridRMSNormGated)
