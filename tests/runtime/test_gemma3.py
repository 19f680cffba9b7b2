"""Gemma 3 text (Gemma3ForCausalLM) against transformers' own model (float32): logits past the sliding
window, greedy decoding through the paged engine (both rotary tables, the KV cache), quantized builds,
tensor parallelism, a pre-quantized import, how the config is read, and every refusal."""


import pytest
import torch
from safetensors.torch import load_file

from llmc.compiler.build import build
from llmc.compiler.export import export_artifact
from llmc.compiler.hf_checkpoint import model_config_from_hf, model_spec_for, read_hf_config
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ArtifactError, CheckpointError
from llmc.runtime.artifact import read_manifest
from llmc.runtime.llm import LLM
from llmc.runtime.models import gemma3
from llmc.runtime.sampling_params import SamplingParams
from tests.runtime.hf_oracle import check_pack_quantized_import
from tests.runtime.hf_oracle import build_float32 as _build
from tests.runtime.hf_oracle import check_against_transformers, check_quantized_build, check_tensor_parallel
from tests.runtime.hf_oracle import write_config as _write_config

PROMPTS = ["ROMEO:", "What light through yonder window breaks? It is the east", "In the beginning"]
GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def artifact(tiny_gemma3, tmp_path_factory):
    return _build(tiny_gemma3, tmp_path_factory.mktemp("gemma3") / "a")


def test_logits_match_transformers_past_the_window(tiny_gemma3, artifact, hf_logits, hf_encode):
    """50 positions, the window 8: sliding layers (local rope) and the full layer (linear-scaled rope)."""
    token_ids = hf_encode(tiny_gemma3, PROMPTS[1]) + list(range(100, 140))
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=16)  # prefilled in chunks
    torch.testing.assert_close(llm.engine.score(token_ids), hf_logits(tiny_gemma3, token_ids), atol=1e-4, rtol=1e-4)


def test_greedy_matches_transformers_with_continuous_batching(tiny_gemma3, artifact, hf_greedy, hf_encode):
    expected = hf_greedy(tiny_gemma3, PROMPTS, GREEDY.max_tokens)
    assert all(len(set(tokens)) > 12 for tokens in expected)  # not a model that repeats one token
    llm = LLM(artifact, device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64)
    outputs = llm.generate([{"prompt_token_ids": hf_encode(tiny_gemma3, p)} for p in PROMPTS], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_the_artifact_holds_folded_norms_and_the_model_config(tiny_gemma3, artifact):
    """Every norm stored as 1 + w (the checkpoint's w); the manifest says what the runtime needs."""
    hf = load_file(tiny_gemma3 / "model.safetensors")
    ours = load_file(artifact / "rank-00" / "weights.safetensors")
    for runtime, name in {**gemma3.GEMMA3_NORMS, **gemma3.QK_NORMS}.items():
        torch.testing.assert_close(ours[f"layers.1.{runtime}.weight"], 1 + hf[f"model.layers.1.{name}.weight"],
                                   rtol=0, atol=0)
    torch.testing.assert_close(ours["norm.weight"], 1 + hf["model.norm.weight"], rtol=0, atol=0)
    assert "lm_head.weight" not in ours  # tied
    model = read_manifest(artifact).model
    assert (model.family, model.hidden_act, model.query_pre_attn_scalar, model.sandwich_norms) == \
        ("gemma3", "gelu_pytorch_tanh", 24.0, True)
    assert model.sliding_window == 8 and model.sliding_window_layers == [0, 2]
    assert (model.rope_theta, model.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 4.0})
    assert (model.rope_local_theta, model.rope_local_scaling) == (1e4, None)
    assert model.embed_scale == torch.tensor(96**0.5).item()  # float32 sqrt(96)
    assert read_manifest(artifact).runtime.max_model_len == 256


def test_published_config_keys_read_as_transformers_reads_them(tiny_gemma3):
    """gemma-3 configs on the hub: rope_theta + rope_scaling (full layers), rope_local_base_freq (sliding),
    sliding_window_pattern instead of layer_types; transformers' reading of them is the reference. The
    embedding scale is rounded to the model dtype as Gemma3TextScaledWordEmbedding rounds it, and the
    default context is max_position_embeddings, not scaled (vLLM's rule for Gemma 3)."""
    from transformers import Gemma3TextConfig

    from llmc.runtime.options import max_model_len_problem

    base = {k: v for k, v in read_hf_config(tiny_gemma3).items() if k not in ("rope_parameters", "layer_types")}
    legacy = {**base, "num_hidden_layers": 7, "sliding_window_pattern": 3, "rope_theta": 5e5,
              "rope_local_base_freq": 2e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
              "max_position_embeddings": 64}
    theirs = Gemma3TextConfig(**{k: v for k, v in legacy.items() if k not in ("architectures", "model_type")})
    ours = model_config_from_hf(legacy, gemma3.SPEC, "bfloat16")
    sliding = [i for i, kind in enumerate(theirs.layer_types) if kind == "sliding_attention"]
    assert ours.sliding_window_layers == sliding == [0, 1, 3, 4, 6]
    full, local = theirs.rope_parameters["full_attention"], theirs.rope_parameters["sliding_attention"]
    assert (ours.rope_theta, ours.rope_scaling) == (full["rope_theta"], {"rope_type": "linear", "factor": 8.0})
    assert (ours.rope_local_theta, ours.rope_local_scaling, local["rope_type"]) == (local["rope_theta"], None, "default")
    assert ours.embed_scale == torch.tensor(96**0.5).to(torch.bfloat16).item() == 9.8125
    assert max_model_len_problem(64, ours) is None and "exceeds the model's context of 64" in max_model_len_problem(65, ours)


@torch.inference_mode()
@pytest.mark.parametrize("quantization", [
    {"method": "rtn", "bits": 4, "group_size": 32},
    pytest.param({"method": "rtn", "bits": 8, "group_size": 32}, marks=pytest.mark.slow),
    {"method": "gptq", "bits": 4, "group_size": 32},
    {"method": "awq", "bits": 4, "group_size": 32},
    pytest.param({"method": "fp8"}, marks=pytest.mark.slow),  # 2 s; tests/compiler covers FP8 linears
], ids=["rtn-w4", "rtn-w8", "gptq-w4", "awq-w4", "fp8"])
def test_quantized_builds_run_transformers_gemma3_on_their_weights(quantization, tiny_gemma3, tmp_path, data_dir,
                                                                   hf_encode):
    """Each int build is transformers' Gemma3ForCausalLM run on the artifact's own weights (dequantized, the
    norms unfolded): logits and greedy tokens. AWQ's scales folded into the (1 + w) norms are in those weights;
    FP8's dynamic activations are each layer linear's input rounded to E4M3 per token (GELU · up's for down)."""
    check_quantized_build(tiny_gemma3, tmp_path, data_dir, hf_encode, quantization, PROMPTS)


@pytest.mark.slow  # 4 s on 2 cores; Gemma 2's (caps per rank) runs by default
def test_tensor_parallel_matches_one_rank(tiny_gemma3, artifact, tmp_path, hf_encode):
    check_tensor_parallel(tiny_gemma3, artifact, tmp_path, hf_encode, PROMPTS, GREEDY)


def test_a_compressed_tensors_checkpoint_imports(tiny_gemma3, tmp_path, hf_logits, hf_encode):
    """A pack-quantized W4 Gemma 3 (every decoder linear, as llm-compressor saves it): its levels are imported,
    the norms folded as in any build, and the logits are transformers' on the dequantized twin."""
    check_pack_quantized_import(tiny_gemma3, tmp_path, hf_logits, hf_encode, PROMPTS[1])


def test_a_final_soft_cap_in_a_gemma3_config_runs_as_transformers_runs_it(tiny_gemma3, tmp_path, hf_logits,
                                                                           hf_encode):
    """Gemma 3 configs set final_logit_softcapping to null, but Gemma3ForCausalLM applies it when set (as Gemma
    2's): read, not refused, and the logits are transformers'."""
    checkpoint = _write_config(tiny_gemma3, tmp_path / "ckpt", final_logit_softcapping=1.5)
    out = _build(checkpoint, tmp_path / "a")
    model = read_manifest(out).model
    assert (model.attn_logit_softcapping, model.final_logit_softcapping) == (None, 1.5)
    token_ids = hf_encode(checkpoint, PROMPTS[1]) + list(range(100, 120))
    expected = hf_logits(checkpoint, token_ids)
    torch.testing.assert_close(LLM(out, device="cpu", max_num_batched_tokens=16).engine.score(token_ids), expected,
                               atol=1e-4, rtol=1e-4)
    assert not torch.allclose(expected, hf_logits(tiny_gemma3, token_ids), atol=0.05)  # the cap changed them


@pytest.mark.parametrize("changes,message", [
    ({"architectures": ["GemmaForCausalLM"], "model_type": "gemma"}, "GemmaForCausalLM: Gemma 1 is not supported"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0: transformers' Gemma 3 attention does not apply it"),
    ({"final_logit_softcapping": "30"}, "final_logit_softcapping '30': a soft cap must be a positive number"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention: true"),
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported for Gemma 3"),
    ({"attention_bias": True}, "attention_bias: true is not supported for Gemma 3"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "Gemma 3 keeps one per layer type"),
], ids=["gemma1", "attn-softcap", "final-softcap-text", "bidirectional", "gelu-exact",
        "attention-bias", "flat-rope"])
def test_what_llmc_does_not_run_is_refused_by_name(tiny_gemma3, tmp_path, changes, message):
    checkpoint = _write_config(tiny_gemma3, tmp_path / "ckpt", **changes)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config = read_hf_config(checkpoint)
        model_config_from_hf(config, model_spec_for(config, checkpoint), "float32")


def test_onnx_cpu_matches_transformers(tiny_gemma3, tmp_path, hf_greedy, hf_logits, hf_encode):
    """The onnx-cpu graph (onnxruntime): sandwich norms, GELU-tanh, the embedding scale, the attention scale, the
    sliding layers' own rotary table and window: transformers' logits past the window and its greedy tokens."""
    out = _build(tiny_gemma3, tmp_path / "onnx", target={"device": "onnx-cpu"})
    ops = read_manifest(out).target["onnx"]["op_counts"]
    assert ops["Gelu"] == 3 and ops["RMSNormalization"] == 1 + 2 * 3 + 2 * 3  # the first norm, q/k, sandwich
    llm = LLM(out, device="cpu", max_num_seqs=2, max_num_batched_tokens=16)
    check_against_transformers(llm, tiny_gemma3, PROMPTS, GREEDY, hf_greedy, hf_logits, hf_encode, 1e-4)


def test_export_is_refused_by_name(artifact, tmp_path):
    with pytest.raises(ArtifactError, match="cannot export architecture Gemma3ForCausalLM"):
        export_artifact(artifact, tmp_path / "export")


# ---- on a GPU ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_float32_on_the_gpu_matches_transformers(tiny_gemma3, artifact, hf_greedy, hf_logits, hf_encode, free_gpu):
    """The Triton attention (both rotary tables, the window), norm and GELU-tanh kernels, CUDA graphs."""
    llm = LLM(artifact, device="cuda", gpu_memory_utilization=0.3, max_num_seqs=2, max_num_batched_tokens=16)
    check_against_transformers(llm, tiny_gemma3, PROMPTS, GREEDY, hf_greedy, hf_logits, hf_encode, 2e-3)
    llm.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("quantization,dtype,min_cosine,mean_cosine", [
    ({"method": "rtn", "bits": 4, "group_size": 32}, "bfloat16", 0.98, 0.997),
    ({"method": "fp8"}, "float32", 0.95, 0.99),
], ids=["w4a16-bf16", "fp8-float32"])
def test_quantized_on_the_gpu_computes_the_cpu_s_model(quantization, dtype, min_cosine, mean_cosine, tiny_gemma3,
                                                       tmp_path, hf_encode, free_gpu):
    """W4A16 in bf16 (the GEMM, then the GELU-tanh kernel: the SiLU epilogue is bypassed) and FP8 W8A8 (GELU-tanh · up
    quantized for down in one kernel) on CUDA against the same artifact on the CPU (dequantized weights, torch).
    The bounds are what the two paths' roundings leave on this small, sensitive model (logits' std 0.6):
    `python benchmarks/gpu_cpu_agreement.py` on an H200 (session 37) gave W4A16 bf16 cosine min 0.993 / mean
    0.9987 and FP8 float32 0.977 / 0.9957 (Llama's FP8 float32: 0.995 / 0.999); float32 dense and W4A16 are
    identical on both devices."""
    out = tmp_path / "q"
    build(recipe_from_dict({"model": str(tiny_gemma3), "output": str(out), "dtype": dtype,
                            "runtime": {"max_model_len": 256}, "quantization": quantization}), show_progress=False)
    token_ids = hf_encode(tiny_gemma3, PROMPTS[1]) + list(range(100, 140))
    cpu = LLM(out, device="cpu").engine.score(token_ids).float()
    llm = LLM(out, device="cuda", gpu_memory_utilization=0.3)
    gpu = llm.engine.score(token_ids).float().cpu()
    llm.close()
    cosine = torch.nn.functional.cosine_similarity(gpu, cpu, dim=-1)
    assert cosine.min().item() > min_cosine and cosine.mean().item() > mean_cosine, cosine
