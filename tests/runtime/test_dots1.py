"""dots.llm1 (Dots1ForCausalLM) against transformers' own model (float32): logits at every position of a chunked
prefill, greedy tokens and their logprobs of prompts batched through the paged engine, without and with a sliding
window over its later layers (Dots1Config's layer_types rule), on the CPU path and on the Triton path (the attention
and fused-MoE kernels under TRITON_INTERPRET=1 on CPU tensors); its router against transformers' Dots1TopkRouter; W4
(RTN, GPTQ; AWQ -m slow) and FP8 builds against transformers holding their dequantized weights; tensor parallel 2
against one rank; how configs are read; the refusals; -m gpu: CUDA. The checkpoints carry a random
e_score_correction_bias (transformers writes zeros), so the biased choice within the groups is checked."""

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (triton reads it then)

import pytest
import torch

from llmc.compiler.build import build
from llmc.compiler.export import export_artifact
from llmc.compiler.hf_checkpoint import model_config_from_hf, read_hf_config
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ArtifactError, CheckpointError, ConfigError, RecipeError
from llmc.runtime.artifact import read_manifest
from llmc.runtime.llm import LLM
from llmc.runtime.models import spec_for_architecture
from llmc.runtime.sampling_params import SamplingParams
from tests.conftest import make_hf_checkpoint
from tests.runtime.hf_oracle import (MOE_QUANTIZATIONS, MOE_QUANTIZATION_IDS, build_quantized,
                                     check_moe_build_as_oracle, check_tensor_parallel, float32_artifacts, moe_hf_state,
                                     write_config)
from tests.runtime.test_glm4_moe import PROMPTS, _check, _random_score_bias, check_v3_router
from tests.runtime.test_glm4_moe import triton_dispatch  # noqa: F401 (a fixture)

KINDS = ("full", "sliding")  # every layer full; layers 1 and 2 over an 8-token window (max_window_layers 1)
# a dots.llm1-sized config (dots.llm1.inst's keys and sizes as recalled: not checked against the hub, unreachable here)
DOTS_LLM1 = {"architectures": ["Dots1ForCausalLM"], "model_type": "dots1", "attention_bias": False,
             "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 10944,
             "max_position_embeddings": 32768, "max_window_layers": 62, "moe_intermediate_size": 1408,
             "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 128, "n_shared_experts": 2, "norm_topk_prob": True,
             "num_attention_heads": 32, "num_experts_per_tok": 6, "num_hidden_layers": 62, "num_key_value_heads": 32,
             "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 10000000, "routed_scaling_factor": 2.5,
             "scoring_func": "sigmoid", "sliding_window": None, "tie_word_embeddings": False, "topk_group": 1,
             "topk_method": "noaux_tc", "use_sliding_window": False, "vocab_size": 152064}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dots1")
    made = {"full": make_hf_checkpoint(root / "full", "dots1"),
            "sliding": make_hf_checkpoint(root / "sliding", "dots1", sliding_window=8, max_window_layers=1)}
    for checkpoint in made.values():
        _random_score_bias(checkpoint, mtp=False)
    return made


@pytest.fixture(scope="module")
def artifacts(checkpoints, tmp_path_factory):
    return float32_artifacts(checkpoints, tmp_path_factory.mktemp("dots1_artifacts"))


@torch.inference_mode()
@pytest.mark.parametrize("kind", KINDS)
def test_logits_greedy_and_logprobs_match_transformers(kind, checkpoints, artifacts, hf_logits, hf_greedy, hf_encode):
    """Logits over 40 positions prefilled in chunks of 16 (1e-4), greedy tokens of 3 prompts batched and their
    logprobs as transformers'; the manifest says Qwen3's attention (q/k norms, whole-head rotary, no biases) and
    DeepSeek-V3's routing."""
    with LLM(artifacts(kind), device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        _check(llm, checkpoints[kind], hf_logits, hf_greedy, hf_encode)
    model = read_manifest(artifacts(kind)).model
    assert (model.family, model.qk_norm, model.rotary_dim, model.attention_bias, model.rotary_rows_permuted) == (
        "dots1", True, None, False, False)
    assert (model.sliding_window, model.sliding_window_layers) == ((None, None) if kind == "full" else (8, [1, 2]))
    if kind == "sliding":  # (the same weights as "full": the window changes transformers' logits past 8 tokens)
        token_ids = hf_encode(checkpoints[kind], PROMPTS[1]) + list(range(100, 126))
        assert (hf_logits(checkpoints["full"], token_ids) - hf_logits(checkpoints[kind], token_ids)).abs().max() > 0.1
    assert (model.moe_layers, model.shared_expert_intermediate_size, model.router_groups, model.router_in_float32) == (
        [1, 2], 64, 2, True)


@torch.inference_mode()
def test_the_triton_path_matches_transformers(checkpoints, artifacts, triton_dispatch, hf_logits, hf_greedy,  # noqa: F811
                                              hf_encode):
    """The rotary + KV-write and attention kernels (q/k norms before them, the sliding window) and the fused MoE kernel
    (DeepSeek's routing weights) give transformers' logits, greedy tokens and logprobs."""
    with LLM(artifacts("sliding"), device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        _check(llm, checkpoints["sliding"], hf_logits, hf_greedy, hf_encode, PROMPTS[:2])
    assert triton_dispatch["rotate_and_write_kv"] and triton_dispatch["fused_moe"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
@pytest.mark.parametrize("kind", KINDS)
def test_on_the_gpu(kind, checkpoints, artifacts, hf_logits, hf_greedy, hf_encode, free_gpu):
    """The float32 artifacts on CUDA (Triton attention, fused MoE, CUDA graphs): transformers' logits (2e-3, as the
    other MoE families' GPU tests), greedy tokens and logprobs."""
    with LLM(artifacts(kind), device="cuda", gpu_memory_utilization=0.3, max_num_seqs=3,
             max_num_batched_tokens=16) as llm:
        assert all(layer.moe.runs_fused() for layer in llm.engine.runner.model.layers.values() if layer.is_moe)
        _check(llm, checkpoints[kind], hf_logits, hf_greedy, hf_encode, tolerance=2e-3)


def test_the_router_is_transformers_router():
    """deepseek_route against transformers' Dots1TopkRouter on 512 random tokens (groups of 4 choosing 2, renormalised
    and scaled; one group, not renormalised): the same experts, the same weights."""
    from transformers import Dots1Config
    from transformers.models.dots1.modeling_dots1 import Dots1TopkRouter

    check_v3_router(Dots1Config, Dots1TopkRouter, (((4, 2), True, 2.5), ((1, 1), False, 1.0)), seed=1)


@torch.inference_mode()
@pytest.mark.parametrize("quantization", MOE_QUANTIZATIONS, ids=MOE_QUANTIZATION_IDS)
def test_a_quantized_build_runs_transformers_on_its_weights(quantization, checkpoints, tmp_path, hf_encode, data_dir):
    """A W4 build (every linear and expert: qkv, o, the dense MLP, the shared experts, the experts) and an FP8 one (its
    linears; each input rounded to E4M3 per token in transformers too) against transformers' model holding its
    dequantized weights: logits over 34 positions (1e-4) and 12 greedy tokens; with layer 1's experts reordered
    in transformers' copy the logits move."""
    checkpoint = checkpoints["full"]
    out = build_quantized(checkpoint, tmp_path, data_dir, quantization)
    modules = read_manifest(out).quant.modules
    formats = {modules[f"layers.{i}.{name}"]["format"] for i, name in ((0, "mlp.down"), (1, "attn.qkv"),
                                                                       (1, "moe.shared.down"))}
    experts = {modules[f"layers.1.moe.experts.{name}"]["format"] for name in ("gate_up", "down")}
    fp8 = quantization["method"] == "fp8"
    assert (formats, experts) == (({"w8a8-fp8"}, {"dense"}) if fp8 else ({"w4a16"}, {"w4a16"}))
    check_moe_build_as_oracle(out, checkpoint, moe_hf_state(out), hf_encode, PROMPTS, fp8)


@torch.inference_mode()
@pytest.mark.slow
def test_tensor_parallel_2_is_one_rank(checkpoints, artifacts, tmp_path, hf_encode):
    """Tensor parallel 2 (each rank its heads, the q/k norms whole; the experts, dense MLP and shared experts split by
    columns; the router whole): the one-rank artifact's greedy tokens and logits (5e-5)."""
    check_tensor_parallel(checkpoints["full"], artifacts("full"), tmp_path, hf_encode, PROMPTS[:2],
                          SamplingParams(temperature=0, max_tokens=8), atol=5e-5)


def test_configs_read_as_transformers_reads_them(checkpoints):
    """The tiny checkpoints' configs (the sliding layers by Dots1Config's layer_types) and a dots.llm1-sized one (its
    old rope_theta, head_dim from hidden_size, MHA, 2 shared experts as one of 2 x 1408, the MoE from layer 1 on):
    the fields, and the parameters transformers counts (cut to 2 layers, on the meta device)."""
    from transformers import AutoModelForCausalLM, Dots1Config

    spec = spec_for_architecture("Dots1ForCausalLM")
    sliding = read_hf_config(checkpoints["sliding"])
    config = model_config_from_hf(sliding, spec, "float32")
    want = [i for i, kind in enumerate(sliding["layer_types"]) if kind == "sliding_attention"]
    assert config.sliding_window_layers == want == [1, 2]
    assert config.num_parameters == AutoModelForCausalLM.from_pretrained(
        str(checkpoints["sliding"])).num_parameters()
    dots = model_config_from_hf(DOTS_LLM1, spec, "bfloat16")
    assert (dots.head_dim, dots.num_kv_heads, dots.rope_theta, dots.qk_norm, dots.sliding_window) == (
        128, 32, 1e7, True, None)
    assert (dots.num_experts, dots.num_experts_per_tok, dots.shared_expert_intermediate_size, dots.moe_layers[:2],
            len(dots.moe_layers), dots.router_groups, dots.routed_scaling_factor) == (128, 6, 2816, [1, 2], 61, 1, 2.5)
    short = {**DOTS_LLM1, "num_hidden_layers": 2}
    hf_config = Dots1Config(**{k: v for k, v in short.items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        count = AutoModelForCausalLM.from_config(hf_config).num_parameters()
    assert model_config_from_hf(short, spec, "bfloat16").num_parameters == count


def test_what_dots1_refuses(checkpoints, artifacts, tmp_path):
    """Refused by name: an ONNX target and int8 (as every MoE family), another router, moe_layer_freq, groups that do
    not split the experts, attention_bias (Qwen3's o_proj bias), `llmc export`, speculative method mtp."""
    def refused(error, match, recipe=None, **changes):
        checkpoint = write_config(checkpoints["full"], tmp_path / f"c{len(list(tmp_path.iterdir()))}", **changes) \
            if changes else checkpoints["full"]
        with pytest.raises(error, match=match):
            build(recipe_from_dict({"model": str(checkpoint), "output": str(tmp_path / "out"), "dtype": "float32",
                                    **(recipe or {})}), show_progress=False)

    refused(RecipeError, "not exported to ONNX", recipe={"target": {"device": "onnx-cpu"}})
    refused(RecipeError, "quantization.method int8", recipe={"quantization": {"method": "int8"}})
    refused(CheckpointError, r"scoring_func 'softmax', topk_method None: transformers' dots.llm1 routes by sigmoid",
            scoring_func="softmax")
    refused(CheckpointError, "topk_method 'greedy'", topk_method="greedy")
    refused(CheckpointError, "moe_layer_freq 2: transformers' dots.llm1 ignores it", moe_layer_freq=2)
    refused(CheckpointError, "n_group 3, topk_group 1", n_group=3)
    refused(CheckpointError, "dots1 checkpoints with attention_bias", attention_bias=True)
    with pytest.raises(ArtifactError, match="architecture Dots1ForCausalLM; export writes"):
        export_artifact(artifacts("full"), tmp_path / "export")
    with pytest.raises(ConfigError, match=r"holds no multi-token-prediction layer \(llmc builds GLM-4.5's"):
        LLM(artifacts("full"), device="cpu", speculative={"method": "mtp", "num_speculative_tokens": 1})
