"""MiniMax-M2 (MiniMaxM2ForCausalLM) against transformers' own model (float32): logits at every position of a chunked
prefill, greedy tokens and their logprobs of prompts batched through the paged engine, on the CPU path and on the
Triton path (the attention and fused-MoE kernels under TRITON_INTERPRET=1 on CPU tensors); its router against
transformers' MiniMaxM2TopKRouter; RTN and GPTQ W4 (AWQ -m slow) and FP8 builds against transformers holding their
dequantized weights; tensor parallel 2 against one rank (-m slow); how configs are read; the refusals; -m gpu: CUDA.
The checkpoint's rotary covers 16 of each head's 32 dims (the legacy rotary_dim) under q/k norms over the whole
projections, so the build's row permutation moves the norms' weights too, and it carries a random
e_score_correction_bias (transformers writes zeros), so the biased choice is checked. Its block-FP8 import:
tests/quant/test_fp8_import_permuted.py."""

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (triton reads it then)

import pytest
import torch

from llmc.compiler.build import build
from llmc.compiler.export import export_artifact
from llmc.compiler.hf_checkpoint import model_config_from_hf, read_hf_config
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ArtifactError, CheckpointError, RecipeError
from llmc.runtime.artifact import read_manifest
from llmc.runtime.llm import LLM
from llmc.runtime.models import spec_for_architecture
from llmc.runtime.models.moe import deepseek_route
from llmc.runtime.sampling_params import SamplingParams
from tests.conftest import make_hf_checkpoint
from tests.runtime.hf_oracle import (MOE_QUANTIZATIONS, MOE_QUANTIZATION_IDS, assert_same_routes, build_quantized,
                                     check_moe_build_as_oracle, check_tensor_parallel, moe_hf_state,
                                     write_config)
from tests.runtime.hf_oracle import artifact_fixture
from tests.runtime.test_glm4_moe import GREEDY, PROMPTS, _check, _random_score_bias
from tests.runtime.test_glm4_moe import triton_dispatch  # noqa: F401 (a fixture)

# MiniMax-M2's config.json as published (MiniMaxAI/MiniMax-M2; keys and sizes as recalled: not checked against the hub,
# unreachable here), without its quantization_config
MINIMAX_M2 = {"architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "attn_type_list": [1] * 62,
              "head_dim": 128, "hidden_act": "silu", "hidden_size": 3072, "intermediate_size": 1536,
              "max_position_embeddings": 196608, "mtp_transformer_layers": 1, "num_attention_heads": 48,
              "num_experts_per_tok": 8, "num_hidden_layers": 62, "num_key_value_heads": 8, "num_local_experts": 256,
              "num_mtp_modules": 3, "qk_norm_type": "per_layer", "rms_norm_eps": 1e-6, "rope_theta": 5000000,
              "rotary_dim": 64, "scoring_func": "sigmoid", "shared_intermediate_size": 0, "tie_word_embeddings": False,
              "use_mtp": True, "use_qk_norm": True, "use_routing_bias": True, "vocab_size": 200064}


def hf_state(artifact) -> dict[str, torch.Tensor]:
    """The artifact's weights as transformers' MiniMaxM2 state dict (hf_oracle.moe_hf_state: q/k rows and the q/k
    norms permuted back, the experts dequantized and stacked), the score bias where MiniMaxM2SparseMoeBlock holds it."""
    return moe_hf_state(artifact, "mlp.e_score_correction_bias")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = make_hf_checkpoint(tmp_path_factory.mktemp("minimax_m2") / "ckpt", "minimax_m2")
    _random_score_bias(made, mtp=False)
    return made


artifact = artifact_fixture("minimax_m2")


@torch.inference_mode()
def test_logits_greedy_and_logprobs_match_transformers(checkpoint, artifact, hf_logits, hf_greedy, hf_encode):
    """Logits over 40 positions prefilled in chunks of 16 (1e-4), greedy tokens of 3 prompts batched and their
    logprobs as transformers'; the manifest says OLMo 2's q/k norms, GLM-4.5's permuted partial rotary and DeepSeek's
    router in float32 without groups."""
    with LLM(artifact, device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        _check(llm, checkpoint, hf_logits, hf_greedy, hf_encode)
    model = read_manifest(artifact).model
    assert (model.family, model.qk_norm, model.qk_norm_full_width, model.rotary_dim, model.rotary_rows_permuted) == (
        "minimax_m2", True, True, 16, True)
    assert (model.moe_layers, model.num_experts, model.num_experts_per_tok, model.moe_intermediate_size,
            model.norm_topk_prob, model.router_scoring, model.router_groups, model.routed_scaling_factor,
            model.shared_expert_intermediate_size, model.router_in_float32) == (
        [0, 1], 8, 2, 32, True, "sigmoid", None, 1.0, None, True)


@torch.inference_mode()
def test_the_triton_path_matches_transformers(checkpoint, artifact, triton_dispatch, hf_logits, hf_greedy,  # noqa: F811
                                              hf_encode):
    """The rotary + KV-write and attention kernels (the whole-width q/k norms before them) and the fused MoE kernel
    give transformers' logits, greedy tokens and logprobs."""
    with LLM(artifact, device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        _check(llm, checkpoint, hf_logits, hf_greedy, hf_encode, PROMPTS[:2])
    assert triton_dispatch["rotate_and_write_kv"] and triton_dispatch["fused_moe"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_on_the_gpu(checkpoint, artifact, hf_logits, hf_greedy, hf_encode, free_gpu):
    """The float32 artifact on CUDA (Triton attention, fused MoE, CUDA graphs): the CPU path's logits (2e-3, as the
    other MoE families' GPU tests; the CPU path holds transformers' to 1e-4 above) and greedy tokens, and transformers'
    where its MiniMaxM2Config reads the legacy rotary_dim (transformers 5.17, on the session-49 device, ignores it and
    rotates whole heads: 15 off, CPU and CUDA alike)."""
    from transformers import MiniMaxM2Config

    token_ids = hf_encode(checkpoint, PROMPTS[1]) + list(range(100, 126))
    params = SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens)
    prompts = [{"prompt_token_ids": hf_encode(checkpoint, p)} for p in PROMPTS]
    with LLM(artifact, device="cpu", max_num_seqs=3, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        cpu_logits = llm.engine.score(token_ids)
        cpu_tokens = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    reads_rotary_dim = bool(MiniMaxM2Config(head_dim=32, rotary_dim=16).rope_parameters.get("partial_rotary_factor"))
    with LLM(artifact, device="cuda", gpu_memory_utilization=0.3, max_num_seqs=3, max_num_batched_tokens=16) as llm:
        assert all(layer.moe.runs_fused() for layer in llm.engine.runner.model.layers.values() if layer.is_moe)
        torch.testing.assert_close(llm.engine.score(token_ids).cpu(), cpu_logits, atol=2e-3, rtol=2e-3)
        assert [out.outputs[0].token_ids for out in llm.generate(prompts, params)] == cpu_tokens
        if reads_rotary_dim:
            _check(llm, checkpoint, hf_logits, hf_greedy, hf_encode, tolerance=2e-3)


def test_the_router_is_transformers_router():
    """deepseek_route (sigmoid, no groups, renormalised, unscaled) against transformers' MiniMaxM2TopKRouter on 512
    random tokens with a random e_score_correction_bias: the same experts, the same weights."""
    from transformers import MiniMaxM2Config
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, 32, generator=gen)
    router = MiniMaxM2TopKRouter(MiniMaxM2Config(hidden_size=32, num_local_experts=16, num_experts_per_tok=3))
    torch.nn.init.normal_(router.weight, generator=gen)
    bias = 0.3 * torch.randn(16, generator=gen)
    with torch.no_grad():
        logits, want_weights, want_ids = router(x, bias)
    weights, ids = deepseek_route(logits, 3, "sigmoid", bias, None, None, True, 1.0)
    assert_same_routes(weights, ids, want_weights, want_ids)
    assert not torch.equal(want_ids.sort(dim=-1).values, torch.topk(logits, 3, dim=-1)[1].sort(dim=-1).values)


@torch.inference_mode()
@pytest.mark.parametrize("quantization", MOE_QUANTIZATIONS, ids=MOE_QUANTIZATION_IDS)
def test_a_quantized_build_runs_transformers_on_its_weights(quantization, checkpoint, tmp_path, hf_encode, data_dir):
    """A W4 build (qkv, o and every expert; GPTQ and AWQ calibrated through the MoE layers) and an FP8 one (its
    linears; each input rounded to E4M3 per token in transformers too) against transformers' model holding its
    dequantized weights (q/k rows and norms permuted back): logits over 34 positions (1e-4) and 12 greedy tokens;
    with layer 1's experts reordered in transformers' copy the logits move."""
    out = build_quantized(checkpoint, tmp_path, data_dir, quantization)
    modules = read_manifest(out).quant.modules
    fp8 = quantization["method"] == "fp8"
    want = "w8a8-fp8" if fp8 else "w4a16"
    assert {modules[f"layers.1.{name}"]["format"] for name in ("attn.qkv", "attn.o")} == {want}
    assert {modules[f"layers.1.moe.experts.{name}"]["format"] for name in ("gate_up", "down")} == {
        "dense" if fp8 else "w4a16"}
    check_moe_build_as_oracle(out, checkpoint, hf_state(out), hf_encode, PROMPTS, fp8)


@torch.inference_mode()
@pytest.mark.slow
def test_tensor_parallel_2_is_one_rank(checkpoint, artifact, tmp_path, hf_encode):
    """Tensor parallel 2 (each rank its heads, the whole-width q/k norms' sums of squares all-reduced; the experts split
    by columns; the router whole): the one-rank artifact's greedy tokens and logits (5e-5)."""
    check_tensor_parallel(checkpoint, artifact, tmp_path, hf_encode, PROMPTS[:2],
                          SamplingParams(temperature=0, max_tokens=8), atol=5e-5)


def test_configs_read_as_transformers_reads_them(checkpoint, caplog):
    """The tiny checkpoint's config and MiniMax-M2's published one (rotary_dim 64 of head_dim 128, rope_theta 5e6,
    eos 200020 by MiniMaxM2Config's default, 256 experts of width 1536, top 8, every layer sparse): the fields, and the
    parameters transformers counts (cut to 2 layers, on the meta device)."""
    from transformers import AutoModelForCausalLM, MiniMaxM2Config

    spec = spec_for_architecture("MiniMaxM2ForCausalLM")
    config = model_config_from_hf(read_hf_config(checkpoint), spec, "float32")
    assert config.num_parameters == AutoModelForCausalLM.from_pretrained(str(checkpoint)).num_parameters()
    m2 = model_config_from_hf(MINIMAX_M2, spec, "bfloat16")
    assert (m2.head_dim, m2.num_kv_heads, m2.rotary_dim, m2.rope_theta, m2.qk_norm_full_width, m2.eos_token_ids) == (
        128, 8, 64, 5e6, True, [200020])
    assert (m2.num_experts, m2.num_experts_per_tok, m2.moe_intermediate_size, len(m2.moe_layers)) == (256, 8, 1536, 62)
    short = {**MINIMAX_M2, "num_hidden_layers": 2}
    hf_config = MiniMaxM2Config(**{k: v for k, v in short.items() if k not in ("architectures", "model_type")})
    assert hf_config.rope_parameters["partial_rotary_factor"] == 0.5
    with torch.device("meta"):
        count = AutoModelForCausalLM.from_config(hf_config).num_parameters()
    assert model_config_from_hf(short, spec, "bfloat16").num_parameters == count


def test_what_minimax_m2_refuses(checkpoint, artifact, tmp_path, caplog):
    """Refused by name: an ONNX target and int8 (as every MoE family), another scoring_func, a shared expert,
    MiniMax-Text-01's linear-attention layers, an integer import (GPTQ: its packed rows do not take the rotary
    permutation, as GLM-4.5's), `llmc export`. Its MTP modules are not built, said in the log."""
    def refused(error, match, recipe=None, **changes):
        source = write_config(checkpoint, tmp_path / f"c{len(list(tmp_path.iterdir()))}", **changes) \
            if changes else checkpoint
        with pytest.raises(error, match=match):
            build(recipe_from_dict({"model": str(source), "output": str(tmp_path / "out"), "dtype": "float32",
                                    **(recipe or {})}), show_progress=False)

    refused(RecipeError, "not exported to ONNX", recipe={"target": {"device": "onnx-cpu"}})
    refused(RecipeError, "quantization.method int8", recipe={"quantization": {"method": "int8"}})
    refused(CheckpointError, r"scoring_func 'softmax': transformers' MiniMax-M2 routes by sigmoid",
            scoring_func="softmax")
    refused(CheckpointError, "shared_intermediate_size 64: transformers' MiniMax-M2 has no shared expert",
            shared_intermediate_size=64)
    refused(CheckpointError, "attn_type_list: layers of type 0", attn_type_list=[0, 1])
    refused(CheckpointError, "import is not supported for MiniMaxM2ForCausalLM from gptq .*: the build permutes "
            "q_proj's and k_proj's rows", recipe={"quantization": {"method": "import"}},
            quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True})
    with pytest.raises(ArtifactError, match="cannot export architecture MiniMaxM2ForCausalLM: the build permuted"):
        export_artifact(artifact, tmp_path / "export")
    source = write_config(checkpoint, tmp_path / "mtp", num_mtp_modules=3, use_mtp=True)
    with caplog.at_level("INFO", logger="llmc"):
        build(recipe_from_dict({"model": str(source), "output": str(tmp_path / "mtp-out"), "dtype": "float32",
                                "target": {"device": "cpu"}}), show_progress=False)
    assert "3 multi-token-prediction modules (num_mtp_modules) are not built" in caplog.text
