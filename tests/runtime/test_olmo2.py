"""OLMo 2 (Olmo2ForCausalLM) against transformers' own model (float32): logits with chunked prefill, the full-width
q/k norms shown to matter, greedy decoding through the paged engine, the norms in the artifact, quantized builds on
their own weights, tensor parallelism (the q/k norms' variance over every rank's heads), ONNX, export and a
pre-quantized import, how the config is read, and every refusal."""


import pytest
import torch
from safetensors.torch import load_file

from llmc.compiler.export import export_artifact
from llmc.compiler.hf_checkpoint import model_config_from_hf, read_hf_config
from llmc.errors import CheckpointError
from llmc.runtime.artifact import read_manifest
from llmc.runtime.llm import LLM
from llmc.runtime.models import olmo2
from llmc.runtime.sampling_params import SamplingParams
from tests.runtime.hf_oracle import check_pack_quantized_import
from tests.runtime.hf_oracle import (build_float32, check_against_transformers, check_quantized_build, check_tensor_parallel,
                                     hf_model_with_config, write_config)

PROMPTS = ["ROMEO:", "What light through yonder window breaks? It is the east", "In the beginning"]
GREEDY = SamplingParams(temperature=0, max_tokens=24)
HEAD_DIM = 16  # tests/conftest.py's tiny OLMo 2: hidden 64, 4 query heads, 2 KV heads


@pytest.fixture(scope="module")
def artifact(tiny_olmo2, tmp_path_factory):
    return build_float32(tiny_olmo2, tmp_path_factory.mktemp("olmo2") / "a")


def _per_head_qk_norms(model) -> None:
    """transformers' model with its q/k norms computed per head (Qwen3's way), the weights unchanged."""
    for layer in model.model.layers:
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            def per_head(x, norm=norm):
                heads = x.float().unflatten(-1, (-1, HEAD_DIM))
                heads = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
                return (norm.weight * heads.flatten(-2)).to(x.dtype)
            norm.forward = per_head


@torch.inference_mode()
def test_logits_match_transformers_and_the_full_width_qk_norms_matter(tiny_olmo2, artifact, hf_logits, hf_encode):
    """50 positions prefilled in chunks of 16. transformers' model with per-head q/k norms (the same weights) is far
    from the model: the variance over the whole projection is what is compared."""
    token_ids = hf_encode(tiny_olmo2, PROMPTS[1]) + list(range(100, 140))
    expected = hf_logits(tiny_olmo2, token_ids)
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=16)
    torch.testing.assert_close(llm.engine.score(token_ids), expected, atol=1e-4, rtol=1e-4)
    assert read_hf_config(tiny_olmo2)["architectures"] == ["Olmo2ForCausalLM"]
    per_head = hf_model_with_config(tiny_olmo2)
    _per_head_qk_norms(per_head)
    moved = per_head(torch.tensor([token_ids])).logits[0]
    assert (moved - expected).abs().mean() > 0.05 * expected.abs().mean()


def test_greedy_matches_transformers_with_continuous_batching(tiny_olmo2, artifact, hf_greedy, hf_encode):
    expected = hf_greedy(tiny_olmo2, PROMPTS, GREEDY.max_tokens)
    assert all(len(set(tokens)) > 10 for tokens in expected)  # not a model that repeats one token
    llm = LLM(artifact, device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64)
    outputs = llm.generate([{"prompt_token_ids": hf_encode(tiny_olmo2, p)} for p in PROMPTS], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_the_artifact_holds_the_norms_and_the_model_config(tiny_olmo2, artifact):
    """No input_norm / post_attn_norm; the sub-layers' output norms and the full-width q/k norms as the checkpoint
    has them; the manifest says so (format 1.10)."""
    hf = load_file(tiny_olmo2 / "model.safetensors")
    ours = load_file(artifact / "rank-00" / "weights.safetensors")
    for i in range(2):
        layer = f"model.layers.{i}."
        for runtime, name in (("attn_out_norm", "post_attention_layernorm"), ("mlp_out_norm", "post_feedforward_layernorm"),
                              ("attn.q_norm", "self_attn.q_norm"), ("attn.k_norm", "self_attn.k_norm")):
            torch.testing.assert_close(ours[f"layers.{i}.{runtime}.weight"], hf[f"{layer}{name}.weight"], rtol=0, atol=0)
            assert (hf[f"{layer}{name}.weight"] - 1).abs().max() > 0.1  # random norms, not transformers' ones
        assert ours[f"layers.{i}.attn.q_norm.weight"].shape == (64,) and ours[f"layers.{i}.attn.k_norm.weight"].shape == (32,)
        assert f"layers.{i}.input_norm.weight" not in ours and f"layers.{i}.post_attn_norm.weight" not in ours
    manifest = read_manifest(artifact)
    model = manifest.model
    assert (model.family, model.pre_norms, model.sandwich_norms, model.qk_norm, model.qk_norm_full_width) == \
        ("olmo2", False, True, True, True)
    assert (model.hidden_act, model.embed_scale, model.attention_scale) == ("silu", None, HEAD_DIM ** -0.5)
    from transformers import AutoModelForCausalLM
    hf_model = AutoModelForCausalLM.from_pretrained(str(tiny_olmo2), dtype=torch.float32)
    assert model.num_parameters == sum(p.numel() for p in hf_model.parameters())
    major, minor = map(int, manifest.format_version.split("."))
    assert (major, minor) >= (1, 10)  # OLMo 2 came in 1.10


def test_published_config_keys_read_as_transformers_reads_them(tiny_olmo2):
    """Keys a config leaves out take Olmo2Config's defaults (rms_norm_eps 1e-5, eos 50279, no bos, KV heads = heads)."""
    from transformers import Olmo2Config

    dropped = ("rms_norm_eps", "eos_token_id", "bos_token_id", "num_key_value_heads", "max_position_embeddings")
    base = {k: v for k, v in read_hf_config(tiny_olmo2).items() if k not in dropped}
    ours = model_config_from_hf(base, olmo2.SPEC, "bfloat16")
    theirs = Olmo2Config(**{k: v for k, v in base.items() if k not in ("architectures", "model_type")})
    assert (ours.rms_norm_eps, ours.eos_token_ids, ours.bos_token_id, ours.num_kv_heads, ours.max_position_embeddings) \
        == (theirs.rms_norm_eps, [theirs.eos_token_id], theirs.bos_token_id, theirs.num_key_value_heads,
            theirs.max_position_embeddings) == (1e-5, [50279], None, 4, 2048)


@torch.inference_mode()
@pytest.mark.parametrize("quantization", [
    {"method": "rtn", "bits": 4, "group_size": 32},
    pytest.param({"method": "gptq", "bits": 4, "group_size": 32}, marks=pytest.mark.slow),  # nothing OLMo's own
    {"method": "awq", "bits": 4, "group_size": 32},
    pytest.param({"method": "fp8"}, marks=pytest.mark.slow),  # 2 s; tests/compiler covers FP8 linears
], ids=["rtn-w4", "gptq-w4", "awq-w4", "fp8"])
def test_quantized_builds_run_transformers_olmo2_on_their_weights(quantization, tiny_olmo2, tmp_path, data_dir,
                                                                  hf_encode):
    """Each build is transformers' Olmo2ForCausalLM run on the artifact's own weights (tests/runtime/hf_oracle.py:
    dequantized; FP8's per-token activation rounding emulated, its qkv and gate_up quantizing the residual stream
    themselves): logits and greedy tokens. AWQ scales only o (no GQA here: not) and down: qkv and gate_up have no
    norm before them to take a scale."""
    check_quantized_build(tiny_olmo2, tmp_path, data_dir, hf_encode, quantization, PROMPTS)


@pytest.mark.slow  # 4 s on 2 cores (tensor parallelism runs by default in tests/runtime/test_parallel*.py)
def test_tensor_parallel_matches_one_rank(tiny_olmo2, artifact, tmp_path, hf_encode):
    """Two ranks: each holds its heads' columns of q_norm / k_norm, and the variance is all-reduced over both."""
    check_tensor_parallel(tiny_olmo2, artifact, tmp_path, hf_encode, PROMPTS, GREEDY)


@pytest.mark.slow  # 4 ranks on the CPU
def test_tensor_parallel_with_replicated_kv_heads_matches_one_rank(tiny_olmo2, artifact, tmp_path, hf_encode):
    """Four ranks over 2 KV heads: each KV head (and its k_norm columns) on two ranks; the all-reduced sum of squares
    counts it twice, over twice the width, so k's variance is still the mean over the distinct heads."""
    check_tensor_parallel(tiny_olmo2, artifact, tmp_path, hf_encode, PROMPTS, GREEDY, tensor=4)


def test_onnx_cpu_matches_transformers(tiny_olmo2, tmp_path, hf_greedy, hf_logits, hf_encode):
    """The onnx-cpu graph (onnxruntime): plain residual Adds where other families norm, the output norms, the q/k
    norms over whole projections: transformers' logits and greedy tokens."""
    out = build_float32(tiny_olmo2, tmp_path / "onnx", target={"device": "onnx-cpu"})
    llm = LLM(out, device="cpu", max_num_seqs=2, max_num_batched_tokens=16)
    check_against_transformers(llm, tiny_olmo2, PROMPTS, GREEDY, hf_greedy, hf_logits, hf_encode, 1e-4)


@torch.inference_mode()
def test_export_is_an_olmo2_checkpoint_transformers_runs(tiny_olmo2, artifact, tmp_path, hf_logits, hf_encode):
    """A float32 export loads in transformers as Olmo2ForCausalLM with the checkpoint's logits, and its config reads
    back to the artifact's ModelConfig."""
    out = export_artifact(artifact, tmp_path / "export").out_dir
    config = read_hf_config(out)
    assert (config["architectures"], config["model_type"]) == (["Olmo2ForCausalLM"], "olmo2")
    assert model_config_from_hf(config, olmo2.SPEC, "float32") == read_manifest(artifact).model
    token_ids = hf_encode(tiny_olmo2, PROMPTS[1]) + list(range(100, 120))
    torch.testing.assert_close(hf_logits(out, token_ids), hf_logits(tiny_olmo2, token_ids), atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_a_compressed_tensors_checkpoint_imports(tiny_olmo2, tmp_path, hf_logits, hf_encode):
    """A pack-quantized W4 OLMo 2 (every decoder linear, as llm-compressor saves it): its levels are imported and the
    logits are transformers' on the dequantized twin."""
    check_pack_quantized_import(tiny_olmo2, tmp_path, hf_logits, hf_encode, PROMPTS[1])


@pytest.mark.parametrize("changes,message", [
    ({"architectures": ["OlmoForCausalLM"], "model_type": "olmo"}, "architecture OlmoForCausalLM: OLMo 1"),
    ({"attention_bias": True}, "attention_bias: true is not supported for OLMo 2"),
], ids=["olmo1", "attention-bias"])  # (OLMo 3 and OLMoE run: tests/runtime/test_more_families.py)
def test_what_llmc_does_not_run_is_refused_by_name(tiny_olmo2, tmp_path, changes, message):
    checkpoint = write_config(tiny_olmo2, tmp_path / "ckpt", **changes)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_float32(checkpoint, tmp_path / "out")


# ---- on a GPU ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_float32_on_the_gpu_matches_transformers(tiny_olmo2, artifact, hf_greedy, hf_logits, hf_encode, free_gpu):
    """The Triton RMSNorm over the whole q / k projections, the residual stream read by qkv and gate_up, the output
    norms (decode, prefill, piecewise and decode CUDA graphs)."""
    llm = LLM(artifact, device="cuda", gpu_memory_utilization=0.3, max_num_seqs=2, max_num_batched_tokens=16)
    check_against_transformers(llm, tiny_olmo2, PROMPTS, GREEDY, hf_greedy, hf_logits, hf_encode, 2e-3)
    llm.close()


def test_inspect_says_no_pre_norms_and_whole_projection_qk_norms(tiny_olmo2, artifact):
    """`llmc inspect` on OLMo 2: q/k norms over the whole projections, norms after the sub-layers only."""
    from click.testing import CliRunner
    from transformers import AutoConfig

    from llmc.cli import cli

    hf = AutoConfig.from_pretrained(tiny_olmo2)
    result = CliRunner().invoke(cli, ["inspect", str(artifact)])
    assert result.exit_code == 0, result.output
    rows = {line[:26].strip(): line[26:] for line in result.output.splitlines()}
    assert rows["attention"] == f"rope theta {hf.rope_parameters['rope_theta']:g}, q/k RMSNorm over the whole projections"
    assert rows["layers"] == "norms after attention and MLP only (no pre-norms)"
