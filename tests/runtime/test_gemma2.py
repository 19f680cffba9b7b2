"""Gemma 2 (Gemma2ForCausalLM) against transformers' own model (float32, eager attention: the one that soft-caps):
logits past the sliding window with both soft caps mattering, greedy decoding and logprobs through the paged
engine, quantized builds, tensor parallelism, how the config is read, and every refusal."""

import pytest
import torch
from safetensors.torch import load_file

from llmc.compiler.export import export_artifact
from llmc.compiler.hf_checkpoint import model_config_from_hf, model_spec_for, read_hf_config
from llmc.errors import ArtifactError, CheckpointError
from llmc.runtime.artifact import read_manifest
from llmc.runtime.llm import LLM
from llmc.runtime.models import gemma2
from llmc.runtime.sampling_params import SamplingParams
from tests.runtime.hf_oracle import (build_float32, check_against_transformers, check_quantized_build, check_tensor_parallel,
                                     hf_model_with_config, write_config)

PROMPTS = ["ROMEO:", "What light through yonder window breaks? It is the east", "In the beginning"]
GREEDY = SamplingParams(temperature=0, max_tokens=24)
ATTN_CAP, FINAL_CAP = 2.0, 1.5  # tests/conftest.py's tiny Gemma 2


@pytest.fixture(scope="module")
def artifact(tiny_gemma2, tmp_path_factory):
    return build_float32(tiny_gemma2, tmp_path_factory.mktemp("gemma2") / "a")


@torch.inference_mode()
def test_logits_match_transformers_past_the_window_with_both_caps_mattering(tiny_gemma2, artifact, hf_logits,
                                                                            hf_encode):
    """50 positions, the window 8, prefilled in chunks of 16. Without its final cap the model's logits pass 1.5,
    and without its attention cap its logits change: both caps shape what is compared."""
    token_ids = hf_encode(tiny_gemma2, PROMPTS[1]) + list(range(100, 140))
    expected = hf_logits(tiny_gemma2, token_ids)
    llm = LLM(artifact, device="cpu", max_num_batched_tokens=16)
    torch.testing.assert_close(llm.engine.score(token_ids), expected, atol=1e-4, rtol=1e-4)
    ids = torch.tensor([token_ids])
    uncapped = hf_model_with_config(tiny_gemma2, final_logit_softcapping=None)(ids).logits[0]
    assert uncapped.abs().max() > 1.5 * FINAL_CAP and expected.abs().max() < FINAL_CAP
    torch.testing.assert_close(torch.tanh(uncapped / FINAL_CAP) * FINAL_CAP, expected, atol=1e-5, rtol=1e-5)
    no_attn_cap = hf_model_with_config(tiny_gemma2, attn_logit_softcapping=None)(ids).logits[0]
    assert (no_attn_cap - expected).abs().max() > 0.1


@torch.inference_mode()
def test_the_attention_scores_pass_the_cap(tiny_gemma2):
    """The attention cap bites: layer 0's scaled scores q.k / sqrt(query_pre_attn_scalar) (transformers'
    own q and k, after the rotary embedding) reach well past ATTN_CAP."""
    from transformers.models.gemma2 import modeling_gemma2

    seen = []

    def spy(module, query, key, value, attention_mask, scaling=None, softcap=None, **kwargs):
        keys = modeling_gemma2.repeat_kv(key, module.num_key_value_groups)  # GQA: each KV head's query heads
        seen.append((query @ keys.transpose(2, 3) * scaling).abs().max().item())
        assert softcap == ATTN_CAP
        return original(module, query, key, value, attention_mask, scaling=scaling, softcap=softcap, **kwargs)

    original = modeling_gemma2.eager_attention_forward
    model = hf_model_with_config(tiny_gemma2)
    try:
        modeling_gemma2.eager_attention_forward = spy
        model(torch.tensor([list(range(5, 45))]))
    finally:
        modeling_gemma2.eager_attention_forward = original
    assert len(seen) == 3 and max(seen) > 2 * ATTN_CAP


def test_greedy_and_logprobs_match_transformers_with_continuous_batching(tiny_gemma2, artifact, hf_greedy, hf_encode,
                                                                         hf_logits):
    """Greedy tokens of three prompts batched; the sampled and prompt logprobs are log_softmax of the capped
    logits (the sampler's path through compute_logits)."""
    expected = hf_greedy(tiny_gemma2, PROMPTS, GREEDY.max_tokens)
    assert all(len(set(tokens)) > 12 for tokens in expected)  # not a model that repeats one token
    llm = LLM(artifact, device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens, logprobs=1, prompt_logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": hf_encode(tiny_gemma2, p)} for p in PROMPTS], params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    prompt, generated = hf_encode(tiny_gemma2, PROMPTS[1]), outputs[1].outputs[0].token_ids
    sequence = prompt + generated
    want = torch.log_softmax(hf_logits(tiny_gemma2, sequence), dim=-1)[:-1].gather(1, torch.tensor(sequence[1:])[:, None])
    got = [entry[token].logprob for entry, token in zip(outputs[1].prompt_logprobs[1:], prompt[1:], strict=True)]
    got += [entry[token].logprob for entry, token in zip(outputs[1].outputs[0].logprobs, generated, strict=True)]
    torch.testing.assert_close(torch.tensor(got)[:, None], want.float(), atol=1e-4, rtol=1e-4)


def test_the_artifact_holds_folded_norms_and_the_model_config(tiny_gemma2, artifact):
    """Every norm stored as 1 + w, no q/k norms, one rotary table; the manifest carries both caps."""
    hf = load_file(tiny_gemma2 / "model.safetensors")
    ours = load_file(artifact / "rank-00" / "weights.safetensors")
    for runtime, name in gemma2.SPEC.layer_norms.items():
        torch.testing.assert_close(ours[f"layers.1.{runtime}.weight"], 1 + hf[f"model.layers.1.{name}.weight"],
                                   rtol=0, atol=0)
    torch.testing.assert_close(ours["norm.weight"], 1 + hf["model.norm.weight"], rtol=0, atol=0)
    assert "lm_head.weight" not in ours and not any("q_norm" in name for name in ours)
    model = read_manifest(artifact).model
    assert (model.family, model.hidden_act, model.query_pre_attn_scalar, model.sandwich_norms, model.qk_norm) == \
        ("gemma2", "gelu_pytorch_tanh", 24.0, True, False)
    assert (model.attn_logit_softcapping, model.final_logit_softcapping) == (ATTN_CAP, FINAL_CAP)
    assert model.sliding_window == 8 and model.sliding_window_layers == [0, 2]
    assert (model.rope_theta, model.rope_scaling, model.rope_local_theta) == (1e4, None, None)
    assert model.embed_scale == torch.tensor(96**0.5).item()
    major, minor = map(int, read_manifest(artifact).format_version.split("."))
    assert (major, minor) >= (1, 7)  # Gemma 2 came in 1.7


def test_published_config_keys_read_as_transformers_reads_them(tiny_gemma2):
    """gemma-2 configs on the hub: no layer_types (Gemma2Config: even layers slide), rope_theta at the top level,
    hidden_act beside hidden_activation; keys left out take Gemma2Config's defaults (caps 50 / 30), an explicit
    null cap is none, as transformers reads them."""
    from transformers import Gemma2Config

    base = {k: v for k, v in read_hf_config(tiny_gemma2).items() if k not in ("rope_parameters", "layer_types")}
    published = {**base, "num_hidden_layers": 5, "rope_theta": 20000.0, "hidden_act": "gelu_pytorch_tanh",
                 "cache_implementation": "hybrid"}
    for changes in ({}, {"attn_logit_softcapping": None, "final_logit_softcapping": None},
                    {"attn_logit_softcapping": 25.0}):
        config = {**{k: v for k, v in published.items() if "softcapping" not in k}, **changes}
        theirs = Gemma2Config(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
        ours = model_config_from_hf(config, gemma2.SPEC, "bfloat16")
        assert ours.sliding_window_layers == [i for i, kind in enumerate(theirs.layer_types)
                                              if kind == "sliding_attention"] == [0, 2, 4]
        assert ours.rope_theta == theirs.rope_parameters["rope_theta"] == 20000.0 and ours.rope_scaling is None
        assert (ours.attn_logit_softcapping, ours.final_logit_softcapping) == \
            (theirs.attn_logit_softcapping, theirs.final_logit_softcapping)
    assert (ours.attn_logit_softcapping, ours.final_logit_softcapping) == (25.0, 30.0)
    defaults = model_config_from_hf({k: v for k, v in published.items() if k not in (
        "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "head_dim")}, gemma2.SPEC,
        "bfloat16")
    assert (defaults.attn_logit_softcapping, defaults.final_logit_softcapping) == (50.0, 30.0)
    assert (defaults.query_pre_attn_scalar, defaults.head_dim) == (256.0, 256)
    assert ours.embed_scale == torch.tensor(96**0.5).to(torch.bfloat16).item() == 9.8125


@torch.inference_mode()
@pytest.mark.parametrize("quantization", [
    {"method": "rtn", "bits": 4, "group_size": 32},
    # calibrated: the same code as Gemma 3's (which runs them by default); with -m slow here
    pytest.param({"method": "gptq", "bits": 4, "group_size": 32}, marks=pytest.mark.slow),
    pytest.param({"method": "awq", "bits": 4, "group_size": 32}, marks=pytest.mark.slow),
    pytest.param({"method": "fp8"}, marks=pytest.mark.slow),  # 2 s; tests/compiler covers FP8 linears
], ids=["rtn-w4", "gptq-w4", "awq-w4", "fp8"])
def test_quantized_builds_run_transformers_gemma2_on_their_weights(quantization, tiny_gemma2, tmp_path, data_dir,
                                                                   hf_encode):
    """Each build is transformers' Gemma2ForCausalLM run on the artifact's own weights (tests/runtime/
    hf_oracle.py: dequantized, norms unfolded, FP8's per-token activation rounding emulated), soft caps and
    all: logits and greedy tokens. GPTQ and AWQ calibrate through the runtime's capped attention."""
    check_quantized_build(tiny_gemma2, tmp_path, data_dir, hf_encode, quantization, PROMPTS)


@pytest.mark.slow  # for the default run's time (session 42)
def test_tensor_parallel_matches_one_rank(tiny_gemma2, artifact, tmp_path, hf_encode):
    """Two ranks: each caps its own vocabulary rows' logits and its own heads' scores."""
    check_tensor_parallel(tiny_gemma2, artifact, tmp_path, hf_encode, PROMPTS, GREEDY)


@pytest.mark.parametrize("changes,message", [
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention: true"),
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported for Gemma 2"),
    ({"attention_bias": True}, "attention_bias: true is not supported for Gemma 2"),
    ({"attn_logit_softcapping": -50.0}, "attn_logit_softcapping -50.0: a soft cap must be a positive number"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "Gemma 2 has one rotary table for every layer"),
], ids=["bidirectional", "gelu-exact", "attention-bias", "negative-cap", "per-layer-type-rope"])
def test_what_llmc_does_not_run_is_refused_by_name(tiny_gemma2, tmp_path, changes, message):
    checkpoint = write_config(tiny_gemma2, tmp_path / "ckpt", **changes)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config = read_hf_config(checkpoint)
        model_config_from_hf(config, model_spec_for(config, checkpoint), "float32")


def test_onnx_cpu_matches_transformers(tiny_gemma2, tmp_path, hf_greedy, hf_logits, hf_encode):
    """The onnx-cpu graph (onnxruntime): GroupQueryAttention's softcap and the logits' Tanh cap besides Gemma's
    norms, GELU-tanh and scales: transformers' logits past the window and its greedy tokens."""
    out = build_float32(tiny_gemma2, tmp_path / "onnx", target={"device": "onnx-cpu"})
    assert read_manifest(out).target["onnx"]["op_counts"]["Tanh"] == 1
    llm = LLM(out, device="cpu", max_num_seqs=2, max_num_batched_tokens=16)
    check_against_transformers(llm, tiny_gemma2, PROMPTS, GREEDY, hf_greedy, hf_logits, hf_encode, 1e-4)


def test_export_is_refused_by_name(artifact, tmp_path):
    with pytest.raises(ArtifactError, match="cannot export architecture Gemma2ForCausalLM"):
        export_artifact(artifact, tmp_path / "export")


# ---- on a GPU ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_float32_on_the_gpu_matches_transformers(tiny_gemma2, artifact, hf_greedy, hf_logits, hf_encode, free_gpu):
    """The Triton attention with its soft cap (decode, prefill, CUDA graphs), the window, the capped logits."""
    llm = LLM(artifact, device="cuda", gpu_memory_utilization=0.3, max_num_seqs=2, max_num_batched_tokens=16)
    check_against_transformers(llm, tiny_gemma2, PROMPTS, GREEDY, hf_greedy, hf_logits, hf_encode, 2e-3)
    llm.close()



@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_kv_heads_and_special_tokens_left_out_take_the_config_class_defaults(tiny_gemma2, family):
    """Gemma2Config and Gemma3TextConfig default num_key_value_heads to 4 (not num_attention_heads), bos to 2 and
    eos to 1: a config.json without them reads as transformers (and vLLM) read it."""
    from transformers import Gemma2Config, Gemma3TextConfig

    from llmc.runtime.models import gemma3

    config = {k: v for k, v in read_hf_config(tiny_gemma2).items()
              if k not in ("num_key_value_heads", "bos_token_id", "eos_token_id", "pad_token_id", "rope_parameters")}
    config = {**config, "num_attention_heads": 8}
    spec, config_class = (gemma2.SPEC, Gemma2Config) if family == "gemma2" else (gemma3.SPEC, Gemma3TextConfig)
    if family == "gemma3":
        config = {**config, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
                  "attn_logit_softcapping": None}
    theirs = config_class(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    ours = model_config_from_hf(config, spec, "float32")
    assert (ours.num_kv_heads, ours.bos_token_id, ours.eos_token_ids) == \
        (theirs.num_key_value_heads, theirs.bos_token_id, [theirs.eos_token_id]) == (4, 2, [1])


def test_inspect_shows_the_window_layout_and_both_caps(tiny_gemma2, artifact):
    """`llmc inspect` says what the artifact runs beyond a Llama layer, read against transformers' own config of
    the checkpoint: the window and which layers use it (layer_types), both caps, the scale, GELU-tanh, the
    sandwich norms and the embedding scale."""
    from click.testing import CliRunner
    from transformers import AutoConfig

    from llmc.cli import cli

    hf = AutoConfig.from_pretrained(tiny_gemma2)
    local = [i for i, kind in enumerate(hf.layer_types) if kind == "sliding_attention"]
    result = CliRunner().invoke(cli, ["inspect", str(artifact)])
    assert result.exit_code == 0, result.output
    rows = {line[:26].strip(): line[26:] for line in result.output.splitlines()}
    assert rows["attention"] == (f"rope theta {hf.rope_parameters['rope_theta']:g}, scale {hf.query_pre_attn_scalar:g}^-0.5, "
                                 f"sliding window {hf.sliding_window} on {len(local)} of {hf.num_hidden_layers} layers, "
                                 f"scores soft-capped at {hf.attn_logit_softcapping:g}")
    assert rows["layers"] == (f"{hf.hidden_activation} MLP, norms after attention and MLP too (sandwich), embeddings x "
                              f"{torch.tensor(hf.hidden_size ** 0.5).item():g}, logits soft-capped at "
                              f"{hf.final_logit_softcapping:g}")
