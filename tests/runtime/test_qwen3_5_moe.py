"""Qwen3.5-MoE (Qwen3_5MoeForCausalLM) against transformers' own model (float32) on a tiny random checkpoint: Qwen3.5's
layer_types [linear, linear, full, linear] (tests/conftest.py), every MLP 4 experts (top 2, renormalised) beside a
gated shared expert: logits over a prefill in chunks of 16, greedy tokens and logprobs of 3 prompts on 2 seats, on the
CPU and with the full layer's attention on the Triton kernels (the interpreter); the experts read from fused
gate_up_proj / down_proj as from per-expert names; RTN and GPTQ W4 builds (experts too) against transformers holding
their dequantized weights; Qwen3_5MoeForConditionalGeneration's language model; the default config's parameter count;
the refusals. Qwen3-Next (Qwen3NextForCausalLM: the same layers with its fused in_proj_qkvz / in_proj_ba, a dense
layer, the top 2 not renormalised): the same checks on the CPU and Triton paths, its weights read back, RTN and GPTQ
W4, its default config. -m gpu: CUDA (graphs and eager) for both."""

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (triton reads it then)

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import CheckpointError, ConfigError, RecipeError, RequestError
from llmc.runtime.artifact import read_manifest
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from tests.conftest import make_hf_checkpoint
from tests.runtime.hf_oracle import (FP8_CHECK, MOE_QUANTIZATIONS, build_float32, build_quantized,
                                     check_moe_build_as_oracle, float32_artifacts, write_config)
from tests.runtime.hf_oracle import family_fixtures
from tests.runtime.test_glm4_moe import PROMPTS, _check
from tests.runtime.test_glm4_moe import triton_dispatch  # noqa: F401 (a fixture)
from tests.runtime.test_qwen3_5 import (assert_reads_back, check_conditional_generation, hf_linears,
                                         check_memory_profile_forward, hf_state)

# Logits' tolerance: this model's logits (std 8) in float32 are 1.7e-4 from exact (transformers' float32 model against
# its float64 copy over the 40 positions _check scores; llmc's 1.5e-4), so 1e-4 would test rounding
TOLERANCE = 2e-4


checkpoint, artifact = family_fixtures("qwen3_5_moe", "qwen3_5_moe")


@torch.inference_mode()
def test_logits_greedy_and_logprobs_match_transformers(checkpoint, artifact, hf_logits, hf_greedy, hf_encode):
    """Logits over 40 positions prefilled in chunks of 16 (TOLERANCE), greedy tokens of 3 prompts on 2 seats and their
    logprobs as transformers'; the manifest: the DeltaNet layers, every layer sparse with the gated shared expert."""
    with LLM(artifact, device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        _check(llm, checkpoint, hf_logits, hf_greedy, hf_encode, tolerance=TOLERANCE)
        assert len(llm.engine.runner.kv_caches) == 1  # the full-attention layer's alone
    model = read_manifest(artifact).model
    assert (model.family, model.linear_attention_layers, model.kv_layers, model.attn_output_gate, model.moe_layers,
            model.num_experts, model.norm_topk_prob, model.shared_expert_intermediate_size,
            model.shared_expert_gate) == ("qwen3_5_moe", [0, 1, 3], [2], True, [0, 1, 2, 3], 4, True, 64, True)


# -m slow: the state kernels' interpreted run is Qwen3.5's, Granite 4.0's, OLMo Hybrid's and LFM2's in the default run
@pytest.mark.slow
@torch.inference_mode()
def test_the_triton_path_matches_transformers(checkpoint, artifact, triton_dispatch, hf_logits, hf_greedy,  # noqa: F811
                                              hf_encode):
    """The full layer's rotary + KV write and paged attention on their Triton kernels, the DeltaNets and the experts in
    torch: transformers' logits, greedy tokens and logprobs."""
    with LLM(artifact, device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        _check(llm, checkpoint, hf_logits, hf_greedy, hf_encode, PROMPTS[:2], tolerance=TOLERANCE)
    assert triton_dispatch["rotate_and_write_kv"]


def _fuse_experts(checkpoint, dest):
    """A copy of `checkpoint` whose experts are each layer's two tensors as transformers 5 holds them (gate_up_proj
    [E, 2 * width, hidden]: gate rows then up; down_proj [E, hidden, width]) instead of per-expert names."""
    source = write_config(checkpoint, dest)
    tensors = load_file(source / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}.mlp.experts."
        pop = [lambda name, e=e: tensors.pop(f"{layer}{e}.{name}.weight") for e in range(config["num_experts"])]
        tensors[layer + "gate_up_proj"] = torch.stack([torch.cat([p("gate_proj"), p("up_proj")]) for p in pop])
        tensors[layer + "down_proj"] = torch.stack([p("down_proj") for p in pop])
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    return source


@torch.inference_mode()
def test_fused_experts_read_as_per_expert_ones(checkpoint, artifact, tmp_path, hf_logits):
    """A checkpoint holding each layer's experts fused (transformers 5's gate_up_proj / down_proj): transformers loads
    it as the per-expert one, and its build's weights are the per-expert build's, tensor for tensor."""
    from transformers import AutoModelForCausalLM

    fused = _fuse_experts(checkpoint, tmp_path / "fused")
    token_ids = list(range(100, 120))
    reference = AutoModelForCausalLM.from_pretrained(str(fused), dtype=torch.float32,
                                                     attn_implementation="eager").eval()
    torch.testing.assert_close(reference(torch.tensor([token_ids])).logits[0], hf_logits(checkpoint, token_ids),
                               atol=1e-5, rtol=1e-5)
    built = build_float32(fused, tmp_path / "a")
    got, want = (load_file(a / "rank-00" / "weights.safetensors") for a in (built, artifact))
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


@torch.inference_mode()
def test_float32_weights_read_back_as_transformers(checkpoint, artifact):
    """hf_state of the float32 build is transformers' own state dict (what the quantized tests' oracle rests on)."""
    assert_reads_back(hf_state(artifact), checkpoint)


@torch.inference_mode()
@pytest.mark.parametrize("method", ["rtn", "gptq", "fp8"])
def test_a_w4_build_runs_transformers_on_its_weights(method, checkpoint, tmp_path, hf_encode, data_dir):
    """RTN and GPTQ (calibrated through the DeltaNet layers and the experts) W4 g32 of every linear and expert (the
    DeltaNets' in_qkvz and out, the full layer's qkv and o, the experts, the shared experts, lm_head; the routers and
    shared gates dense), and FP8 W8A8 (per channel, per token) of the same linears but the experts (dense: hf_oracle.
    MOE_QUANTIZATIONS) and lm_head, against transformers' model holding its dequantized weights, FP8 linears' inputs
    rounded per token: logits over 34 positions (TOLERANCE; FP8: hf_oracle.FP8_CHECK) and 12 greedy tokens; the
    experts of layer 1 reversed in transformers' copy move its logits."""
    fp8 = method == "fp8"
    quantization = MOE_QUANTIZATIONS[-1] if fp8 else {"method": method, "bits": 4, "group_size": 32}
    out = build_quantized(checkpoint, tmp_path, data_dir, quantization)
    modules = read_manifest(out).quant.modules
    linears = [(0, "attn.in_qkvz"), (0, "attn.out"), (2, "attn.qkv"), (2, "attn.o"), (3, "moe.shared.gate_up"),
               (0, "moe.shared.down")]
    experts = [(1, "moe.experts.gate_up"), (3, "moe.experts.down")]
    assert {modules[f"layers.{i}.{name}"]["format"] for i, name in linears} == {"w8a8-fp8" if fp8 else "w4a16"}
    assert {modules[f"layers.{i}.{name}"]["format"] for i, name in experts} == {"dense" if fp8 else "w4a16"}
    state = hf_state(out)
    check_moe_build_as_oracle(out, checkpoint, state, hf_encode, PROMPTS, fp8=fp8, linears=hf_linears(state),
                              **(FP8_CHECK if fp8 else {"tolerance": TOLERANCE}))


@torch.inference_mode()
def test_conditional_generation_serves_its_language_model(checkpoint, tmp_path, hf_logits, hf_encode):
    """Qwen3_5MoeForConditionalGeneration's config form (text_config) and weights (model.language_model.*, its experts
    fused as transformers 5 saves them, a one-layer vision tower beside them): its artifact is the text model's,
    scored as transformers' Qwen3_5MoeForConditionalGeneration loaded from it scores text ids (TOLERANCE); an image is
    refused by name."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    m = check_conditional_generation(checkpoint, tmp_path, hf_logits, hf_encode, Qwen3_5MoeForConditionalGeneration,
                                     Qwen3_5MoeConfig, TOLERANCE)
    assert (m.architecture, m.family, m.linear_attention_layers, m.moe_layers) == (
        "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", [0, 1, 3], [0, 1, 2, 3])


def test_the_default_config_reads_as_transformers():
    """Qwen3_5MoeTextConfig's defaults (transformers' "Qwen3.5-35B-A3B style": 256 experts of width 512, top 8, a shared
    expert of 512; layer_types from full_attention_interval 4) read as transformers reads them: every layer sparse,
    every fourth one full attention, and transformers' parameter count."""
    from transformers import AutoModelForCausalLM, Qwen3_5MoeTextConfig

    from llmc.compiler.hf_checkpoint import model_config_from_hf
    from llmc.runtime.models import spec_for_architecture

    hf_config = Qwen3_5MoeTextConfig(num_hidden_layers=4)
    config = {**hf_config.to_dict(), "architectures": ["Qwen3_5MoeForCausalLM"]}
    config.pop("layer_types")
    model = model_config_from_hf(config, spec_for_architecture("Qwen3_5MoeForCausalLM"), "bfloat16")
    assert (model.linear_attention_layers, model.kv_layers, model.moe_layers, model.num_experts,
            model.num_experts_per_tok, model.moe_intermediate_size, model.shared_expert_intermediate_size) == (
        [0, 1, 2], [3], [0, 1, 2, 3], 256, 8, 512, 512)
    with torch.device("meta"):
        assert model.num_parameters == AutoModelForCausalLM.from_config(hf_config).num_parameters()


def test_the_refusals(checkpoint, artifact, tmp_path):
    """The hybrid refusals hold for the MoE (prefix caching, speculative decoding, beam search; at build ONNX, tensor
    parallel, int8); refused by name at build: mlp_only_layers / decoder_sparse_step (transformers reads neither: every
    layer sparse), norm_topk_prob false (its router renormalises always), a zero shared expert."""
    for match, options in (("enable_prefix_caching: Qwen3_5MoeForCausalLM .* has no prefix caching",
                            {"enable_prefix_caching": True}),
                           ("speculative_config: not supported for Qwen3_5MoeForCausalLM",
                            {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}})):
        with pytest.raises(ConfigError, match=match):
            LLM(artifact, device="cpu", num_kv_blocks=64, **options)
    with LLM(artifact, device="cpu", num_kv_blocks=64) as llm:
        with pytest.raises(RequestError, match="use_beam_search: not supported for Qwen3_5MoeForCausalLM"):
            llm.engine.add_request(None, SamplingParams(use_beam_search=True, n=2, max_tokens=4),
                                   prompt_token_ids=[5, 6, 7])

    def refused(error, match, recipe=None, **changes):
        source = write_config(checkpoint, tmp_path / f"c{len(list(tmp_path.iterdir()))}", **changes) \
            if changes else checkpoint
        with pytest.raises(error, match=match):
            build(recipe_from_dict({"model": str(source), "output": str(tmp_path / "out"), "dtype": "float32",
                                    **(recipe or {})}), show_progress=False)

    refused(RecipeError, "target.device onnx-cpu: .* is not exported to ONNX",
            recipe={"target": {"device": "onnx-cpu"}})
    refused(RecipeError, "parallel: .* runs on one rank", recipe={"parallel": {"tensor": 2}})
    refused(RecipeError, "quantization.method int8: .* builds with none, rtn, gptq, fp8",
            recipe={"quantization": {"method": "int8"}})
    refused(CheckpointError, "mlp_only_layers \\[1\\] .* every Qwen3.5-MoE layer is sparse", mlp_only_layers=[1])
    refused(CheckpointError, "decoder_sparse_step 2: every Qwen3.5-MoE layer is sparse", decoder_sparse_step=2)
    refused(CheckpointError, "norm_topk_prob false: .* renormalises the top-k weights always", norm_topk_prob=False)
    refused(CheckpointError, "shared_expert_intermediate_size 0: Qwen3.5-MoE needs a positive integer",
            shared_expert_intermediate_size=0)


@pytest.fixture(scope="module")
def next_checkpoint(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("qwen3_next") / "ckpt", "qwen3_next")


@pytest.fixture(scope="module")
def next_artifact(next_checkpoint, tmp_path_factory):
    return float32_artifacts({"q": next_checkpoint}, tmp_path_factory.mktemp("qwen3_next_artifacts"))("q")


def next_state(artifact) -> dict[str, torch.Tensor]:
    """A Qwen3-Next artifact's weights as transformers' state dict: hf_state's, each DeltaNet's in_proj_qkv / in_proj_z
    and in_proj_b / in_proj_a grouped back per key head into in_proj_qkvz ([q_g, k_g, v_g, z_g] for key head g) and
    in_proj_ba ([b_g, a_g]), as transformers' Qwen3NextGatedDeltaNet splits them."""
    model = read_manifest(artifact).model
    groups = model.linear_num_key_heads
    state = hf_state(artifact)
    for i in model.linear_attention_layers:
        la = f"model.layers.{i}.linear_attn."
        key = model.linear_num_key_heads * model.linear_key_head_dim
        value = model.linear_num_value_heads * model.linear_value_head_dim
        q, k, v = state.pop(la + "in_proj_qkv.weight").split([key, key, value])
        parts = [t.unflatten(0, (groups, -1)) for t in (q, k, v, state.pop(la + "in_proj_z.weight"))]
        state[la + "in_proj_qkvz.weight"] = torch.cat(parts, dim=1).flatten(0, 1)
        ba = [state.pop(la + f"in_proj_{x}.weight").unflatten(0, (groups, -1)) for x in "ba"]
        state[la + "in_proj_ba.weight"] = torch.cat(ba, dim=1).flatten(0, 1)
    return state


@torch.inference_mode()
def test_qwen3_next_matches_transformers(next_checkpoint, next_artifact, hf_logits, hf_greedy, hf_encode):
    """Qwen3-Next (its fused, per-key-head-grouped in_proj_qkvz / in_proj_ba regrouped at build; layer 1 a dense MLP,
    the top 2 not renormalised): logits over 40 positions prefilled in chunks of 16 (TOLERANCE), greedy tokens of 3
    prompts on 2 seats and their logprobs as transformers'; its weights read back (next_state) are transformers'."""
    with LLM(next_artifact, device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        _check(llm, next_checkpoint, hf_logits, hf_greedy, hf_encode, tolerance=TOLERANCE)
    model = read_manifest(next_artifact).model
    assert (model.family, model.linear_attention_layers, model.moe_layers, model.norm_topk_prob,
            model.intermediate_size, model.shared_expert_gate) == ("qwen3_next", [0, 1, 3], [0, 2, 3], False, 128, True)
    assert_reads_back(next_state(next_artifact), next_checkpoint)


# -m slow: the state kernels' interpreted run is Qwen3.5's, Granite 4.0's, OLMo Hybrid's and LFM2's in the default run
@pytest.mark.slow
@torch.inference_mode()
def test_qwen3_next_on_the_triton_path(next_checkpoint, next_artifact, triton_dispatch, hf_logits,  # noqa: F811
                                       hf_greedy, hf_encode):
    """Qwen3-Next's full layer on the Triton kernels (interpreter): transformers' logits, greedy tokens, logprobs."""
    with LLM(next_artifact, device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        _check(llm, next_checkpoint, hf_logits, hf_greedy, hf_encode, PROMPTS[:2], tolerance=TOLERANCE)
    assert triton_dispatch["rotate_and_write_kv"]


@torch.inference_mode()
@pytest.mark.parametrize("method", ["rtn", pytest.param("gptq", marks=pytest.mark.slow)])
def test_a_qwen3_next_w4_build_runs_transformers_on_its_weights(method, next_checkpoint, tmp_path, hf_encode,
                                                                 data_dir):
    """Qwen3-Next RTN / GPTQ W4 g32 (the regrouped in_qkvz quantized as one linear, the experts, the dense MLP) against
    transformers' model holding its dequantized weights (next_state): logits (TOLERANCE) and 12 greedy tokens; the
    experts of layer 2 reversed there move its logits."""
    out = build_quantized(next_checkpoint, tmp_path, data_dir, {"method": method, "bits": 4, "group_size": 32})
    modules = read_manifest(out).quant.modules
    assert {modules[f"layers.{i}.{name}"]["format"] for i, name in
            [(0, "attn.in_qkvz"), (3, "attn.out"), (1, "mlp.gate_up"), (2, "moe.experts.down")]} == {"w4a16"}
    check_moe_build_as_oracle(out, next_checkpoint, next_state(out), hf_encode, PROMPTS, fp8=False,
                              tolerance=TOLERANCE, moved_layer=2)


def test_qwen3_next_default_config_reads_as_transformers():
    """Qwen3NextConfig's defaults (transformers' "Qwen3-Next-80B-A3B style"; layer_types from full_attention_interval)
    with layer 1 dense read as transformers reads them, and transformers' parameter count."""
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    from llmc.compiler.hf_checkpoint import model_config_from_hf
    from llmc.runtime.models import spec_for_architecture

    hf_config = Qwen3NextConfig(num_hidden_layers=4, mlp_only_layers=[1])
    config = {**hf_config.to_dict(), "architectures": ["Qwen3NextForCausalLM"]}
    config.pop("layer_types")
    model = model_config_from_hf(config, spec_for_architecture("Qwen3NextForCausalLM"), "bfloat16")
    assert (model.linear_attention_layers, model.moe_layers, model.num_experts, model.rotary_dim) == (
        [0, 1, 2], [0, 2, 3], 512, 64)
    with torch.device("meta"):
        assert model.num_parameters == AutoModelForCausalLM.from_config(hf_config).num_parameters()


def test_the_gpu_memory_profile_runs_both(checkpoint, artifact, next_checkpoint, next_artifact, monkeypatch,
                                          hf_logits):
    check_memory_profile_forward(checkpoint, artifact, monkeypatch, hf_logits)
    check_memory_profile_forward(next_checkpoint, next_artifact, monkeypatch, hf_logits)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_on_the_gpu(checkpoint, artifact, next_checkpoint, next_artifact, hf_logits, hf_greedy, hf_encode, free_gpu):
    """The float32 Qwen3.5-MoE and Qwen3-Next artifacts on CUDA (Triton attention in the full layer, the fused MoE
    kernel, the conv and delta rule on their Triton kernels; decode steps replay CUDA graphs, prefill and mixed steps
    eager), then with enforce_eager: transformers' logits (2e-3), greedy tokens and logprobs."""
    for ckpt, built in ((checkpoint, artifact), (next_checkpoint, next_artifact)):
        for eager in (False, True):
            with LLM(built, device="cuda", gpu_memory_utilization=0.3, max_num_seqs=3, max_num_batched_tokens=16,
                     enforce_eager=eager) as llm:
                assert (llm.engine.runner.graphs is None) == eager
                _check(llm, ckpt, hf_logits, hf_greedy, hf_encode, tolerance=2e-3)
