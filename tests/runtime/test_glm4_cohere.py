"""GLM-4 (Glm4ForCausalLM), Cohere 2 (Cohere2ForCausalLM) and Cohere (CohereForCausalLM) against transformers' own
models (float32): the interleaved rotary (GLM-4's partial) against transformers' apply_rotary_pos_emb, logits over
chunked prefill and greedy decoding on the CPU, the Triton rotary, KV-write and attention kernels in Triton's
interpreter, GLM-4's onnx-cpu graph, quantized builds against transformers holding their dequantized weights, how the
configs are read, the artifacts, and every refusal."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from llmc.compiler.export import export_artifact
from llmc.compiler.hf_checkpoint import interleaved_rotary_permutation, model_config_from_hf, read_hf_config
from llmc.errors import ArtifactError, CheckpointError, ConfigError, RecipeError
from llmc.runtime.artifact import read_manifest
from llmc.runtime.layers.rotary import cos_sin_cache
from llmc.runtime.llm import LLM
from llmc.runtime.models import cohere, glm4
from llmc.runtime.sampling_params import SamplingParams
from tests.conftest import REPO_ROOT
from tests.runtime.hf_oracle import (awq_and_rtn_logits, build_float32, build_import, build_quantized,
                                     check_against_oracle, check_against_transformers, hf_model_on_weights_of,
                                     write_config)

PROMPTS = ["ROMEO:", "What light through yonder window breaks? It is the east", "In the beginning"]
GREEDY = SamplingParams(temperature=0, max_tokens=24)
HEAD_DIM, ROTARY_DIM = 32, 16  # tests/conftest.py's tiny GLM-4: hidden 64, 4 query heads, 2 KV heads, factor 0.5


@pytest.fixture(scope="module")
def artifact(tiny_glm4, tmp_path_factory):
    return build_float32(tiny_glm4, tmp_path_factory.mktemp("glm4") / "a")


@pytest.mark.parametrize("head_dim,rotary_dim", [(32, 16), (8, 8), (12, 4)])
def test_the_permuted_whole_head_rotation_is_glms_interleaved_partial_rotary(head_dim, rotary_dim):
    """q and k rotated by transformers' GLM-4 apply_rotary_pos_emb (interleaved pairs of the leading rotary_dim dims),
    against the runtime's: rows permuted (interleaved_rotary_permutation), rotate-half over the whole head with the
    head-wide table (cos 1, sin 0 past rotary_dim / 2), rows permuted back. And q.k is the same either way."""
    from transformers.models.glm4.modeling_glm4 import apply_rotary_pos_emb

    from llmc.kernels.rotary import apply_rotary

    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 5, 17, 63])
    q, k = torch.randn(5, 3, head_dim, generator=gen), torch.randn(5, 3, head_dim, generator=gen)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)
    angles = positions[:, None].float() * inv_freq  # transformers' Glm4RotaryEmbedding
    emb = torch.cat((angles, angles), dim=-1)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1), k.transpose(0, 1), emb.cos(), emb.sin(), unsqueeze_dim=0)
    perm = interleaved_rotary_permutation(head_dim, rotary_dim)
    assert sorted(perm.tolist()) == list(range(head_dim))
    table = cos_sin_cache(rotary_dim, 64, 10000.0, None, head_dim)
    assert table.shape == (64, head_dim)
    got_q, got_k = apply_rotary(q[..., perm], k[..., perm], positions, table)
    inverse = torch.argsort(perm)
    torch.testing.assert_close(got_q[..., inverse], want_q.transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k[..., inverse], want_k.transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close((got_q * got_k).sum(-1), (want_q * want_k).sum(-1).transpose(0, 1), atol=1e-5,
                               rtol=1e-5)


@torch.inference_mode()
def test_logits_and_greedy_tokens_match_transformers(tiny_glm4, artifact, hf_greedy, hf_logits, hf_encode):
    """60 positions prefilled in chunks of 16, then greedy decoding of three prompts with continuous batching."""
    llm = LLM(artifact, device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64)
    check_against_transformers(llm, tiny_glm4, PROMPTS, GREEDY, hf_greedy, hf_logits, hf_encode, 1e-4)
    assert all(len(set(tokens)) > 10 for tokens in hf_greedy(tiny_glm4, PROMPTS, GREEDY.max_tokens))


def test_the_artifact_holds_the_model_as_glm4_reads_it(tiny_glm4, artifact):
    """q/k rows permuted per head (biases too), v and the fused gate_up_proj as stored, the four norms under their
    runtime names, and the manifest's config (format 1.20)."""
    from transformers import AutoModelForCausalLM

    hf = load_file(tiny_glm4 / "model.safetensors")
    ours = load_file(artifact / "rank-00" / "weights.safetensors")
    perm = interleaved_rotary_permutation(HEAD_DIM, ROTARY_DIM)
    for i in range(2):
        layer = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            q, k, v = ours[f"layers.{i}.attn.qkv.{kind}"].split([128, 64, 64])
            for got, name in ((q, "q_proj"), (k, "k_proj")):
                want = hf[f"{layer}self_attn.{name}.{kind}"].unflatten(0, (-1, HEAD_DIM))[:, perm].flatten(0, 1)
                assert torch.equal(got, want)
            assert torch.equal(v, hf[f"{layer}self_attn.v_proj.{kind}"])
        assert torch.equal(ours[f"layers.{i}.mlp.gate_up.weight"], hf[f"{layer}mlp.gate_up_proj.weight"])
        for runtime, name in glm4.GLM4_NORMS.items():
            assert torch.equal(ours[f"layers.{i}.{runtime}.weight"], hf[f"{layer}{name}.weight"])
    manifest = read_manifest(artifact)
    model = manifest.model
    assert (model.family, model.sandwich_norms, model.pre_norms, model.attention_bias, model.qk_norm) == \
        ("glm4", True, True, True, False)
    assert (model.rotary_dim, model.rotary_interleaved, model.rotary_table_dims, model.is_partial_rotary) == \
        (ROTARY_DIM, True, HEAD_DIM, False)
    hf_model = AutoModelForCausalLM.from_pretrained(str(tiny_glm4), dtype=torch.float32)
    assert model.num_parameters == sum(p.numel() for p in hf_model.parameters())
    assert manifest.format_version == "1.47"


def test_published_config_keys_read_as_transformers_reads_them(tiny_glm4):
    """GLM-4-0414's config.json form (rope_theta and partial_rotary_factor at the top level) reads as transformers 5's
    rope_parameters; keys left out take Glm4Config's defaults (factor 0.5, KV heads 2, head_dim 128, biases on)."""
    from transformers import Glm4Config

    saved = read_hf_config(tiny_glm4)
    published = {k: v for k, v in saved.items() if k != "rope_parameters"}
    published.update(rope_theta=10000.0, partial_rotary_factor=0.5)
    assert model_config_from_hf(published, glm4.SPEC, "float32") == model_config_from_hf(saved, glm4.SPEC, "float32")
    dropped = ("rope_parameters", "num_key_value_heads", "head_dim", "attention_bias", "rms_norm_eps")
    base = {k: v for k, v in saved.items() if k not in dropped}
    ours = model_config_from_hf(base, glm4.SPEC, "bfloat16")
    theirs = Glm4Config(**{k: v for k, v in base.items() if k not in ("architectures", "model_type")})
    assert (ours.num_kv_heads, ours.head_dim, ours.attention_bias, ours.rms_norm_eps) == (
        theirs.num_key_value_heads, theirs.head_dim, theirs.attention_bias, theirs.rms_norm_eps)
    assert ours.rotary_dim == int(theirs.head_dim * theirs.rope_parameters["partial_rotary_factor"]) == 64


def _hf_state_of(artifact, logit_scale: float = 1.0) -> dict[str, torch.Tensor]:
    """The artifact's weights as its transformers model's state dict (Glm4ForCausalLM, Cohere2ForCausalLM): each
    linear dequantized by the formats' oracle (quant/reference.py), q/k rows (and biases) permuted back to the
    interleaved rotary layout, qkv split into q/k/v (Cohere's gate_up into gate and up), Cohere's final norm divided
    by its logit_scale (the build folded it in)."""
    from llmc.quant.formats import make_format
    from llmc.quant.reference import dequantize

    manifest = json.loads((artifact / "manifest.json").read_text())
    model = manifest["model"]
    spec = glm4.SPEC if model["family"] == "glm4" else cohere.SPEC2
    tensors = load_file(artifact / "rank-00" / "weights.safetensors")
    head_dim = model["head_dim"]
    inverse = torch.argsort(interleaved_rotary_permutation(head_dim, model.get("rotary_dim") or head_dim))
    q_size, kv_size = model["num_heads"] * head_dim, model["num_kv_heads"] * head_dim

    def unpermute(rows):
        return rows.unflatten(0, (-1, head_dim))[:, inverse].flatten(0, 1)

    state = {"model.embed_tokens.weight": tensors["embed.weight"],
             "model.norm.weight": tensors["norm.weight"] / logit_scale}
    if "lm_head.weight" in tensors:
        state["lm_head.weight"] = tensors["lm_head.weight"]
    for i in range(model["num_layers"]):
        layer = f"model.layers.{i}."
        for runtime, hf in spec.layer_norms.items():
            state[f"{layer}{hf}.weight"] = tensors[f"layers.{i}.{runtime}.weight"]
        for linear in spec.layer_linears:
            prefix = f"layers.{i}.{linear.name}."
            params = {k.removeprefix(prefix): v for k, v in tensors.items()
                      if k.startswith(prefix) and k != prefix + "bias"}
            weight = dequantize(make_format(manifest["quant"]["modules"][prefix[:-1]], torch.float32), params).float()
            if linear.name == "mlp.gate_up" and len(linear.hf_members) == 2:
                gate, up = weight.chunk(2)
                state |= {f"{layer}mlp.gate_proj.weight": gate, f"{layer}mlp.up_proj.weight": up}
            elif linear.name != "attn.qkv":
                state[f"{layer}{linear.hf_members[0]}.weight"] = weight
            else:
                for kind, whole in (("weight", weight), ("bias", tensors.get(prefix + "bias"))):
                    if whole is not None:
                        q, k, v = whole.float().split([q_size, kv_size, kv_size])
                        state |= {f"{layer}self_attn.q_proj.{kind}": unpermute(q),
                                  f"{layer}self_attn.k_proj.{kind}": unpermute(k), f"{layer}self_attn.v_proj.{kind}": v}
    return state


def _check_quantized_build(checkpoint, out, hf_encode, method: str, logit_scale: float = 1.0) -> None:
    """`out` against transformers' model of `checkpoint` holding its dequantized weights (the q/k rows permuted back;
    FP8: each decoder linear's input rounded to E4M3 per token, as its dynamic activations are): logits over 40
    positions to 1e-4 and 16 greedy tokens."""
    assert read_manifest(out).quant.modules["layers.0.attn.qkv"]["format"] != "dense"
    oracle = hf_model_on_weights_of(checkpoint, out, method, _hf_state_of(out, logit_scale))
    check_against_oracle(LLM(out, device="cpu", max_num_batched_tokens=16), oracle, checkpoint, hf_encode, PROMPTS)


@torch.inference_mode()
@pytest.mark.parametrize("quantization", [
    {"method": "rtn", "bits": 4, "group_size": 32},
    pytest.param({"method": "gptq", "bits": 4, "group_size": 32}, marks=pytest.mark.slow),  # RTN's path, calibrated
    {"method": "awq", "bits": 4, "group_size": 32},
    pytest.param({"method": "fp8"}, marks=pytest.mark.slow),  # 2 s; tests/compiler covers FP8 linears
], ids=["rtn-w4", "gptq-w4", "awq-w4", "fp8"])
def test_quantized_builds_run_transformers_glm4_on_their_weights(quantization, tiny_glm4, tmp_path, data_dir,
                                                                 hf_encode):
    """Each build is transformers' Glm4ForCausalLM holding its weights (the q/k rows permuted back). AWQ's folds apply
    as for Gemma (a norm before qkv and gate_up, up before down; o not: grouped-query attention here)."""
    out = build_quantized(tiny_glm4, tmp_path, data_dir, quantization)
    _check_quantized_build(tiny_glm4, out, hf_encode, quantization["method"])


TRITON_SCRIPT = """
import json, os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
import llmc.kernels.attention as attention
attention.can_use_triton = lambda *tensors: True  # the rotary, KV-write and attention kernels, interpreted
from llmc.kernels import attention_triton
calls = {"write": 0, "fused": 0}
write, attend = attention_triton.rotate_and_write_kv, attention_triton.paged_attention
def counted_write(*args, **kwargs):
    calls["write"] += 1
    return write(*args, **kwargs)
def counted_attend(*args, **kwargs):
    calls["fused"] += kwargs.get("rotary") is not None  # a decode step's fused rotary
    return attend(*args, **kwargs)
attention_triton.rotate_and_write_kv, attention_triton.paged_attention = counted_write, counted_attend
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
artifact, prompts, scored = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
llm = LLM(artifact, device="cpu", max_num_batched_tokens=16, max_num_seqs=2, num_kv_blocks=32, block_size=8)
outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=6))
logits = llm.engine.score(scored)
print(json.dumps([calls, [o.outputs[0].token_ids for o in outputs], logits.tolist()]))
"""


def _check_triton_kernels(checkpoint, artifact, hf_greedy, hf_logits, hf_encode) -> None:
    """`artifact` with the rotary + KV-write kernel (prefill chunks of 16) and the decode kernel's fused rotary in
    Triton's interpreter (a subprocess: TRITON_INTERPRET is read at import): transformers' greedy tokens and logits."""
    prompts = [hf_encode(checkpoint, p) for p in PROMPTS[:2]]
    scored = hf_encode(checkpoint, PROMPTS[1]) + list(range(100, 120))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    run = subprocess.run([sys.executable, "-c", TRITON_SCRIPT, str(artifact), json.dumps(prompts), json.dumps(scored)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    calls, tokens, logits = json.loads(run.stdout.strip().splitlines()[-1])
    assert calls["write"] > 0 and calls["fused"] > 0
    assert tokens == hf_greedy(checkpoint, PROMPTS[:2], 6)
    torch.testing.assert_close(torch.tensor(logits), hf_logits(checkpoint, scored), atol=1e-4, rtol=1e-4)


def test_the_triton_kernels_rotate_glm4_as_transformers(tiny_glm4, artifact, hf_greedy, hf_logits, hf_encode):
    """The GPU path on the CPU: the Triton kernels rotate whole heads by the head-wide table."""
    _check_triton_kernels(tiny_glm4, artifact, hf_greedy, hf_logits, hf_encode)


def test_onnx_cpu_matches_transformers(tiny_glm4, tmp_path, hf_greedy, hf_logits, hf_encode):
    """The onnx-cpu graph: GroupQueryAttention rotates whole heads by the head-wide table, q/k/v biases, the output
    norms: transformers' logits and greedy tokens."""
    out = build_float32(tiny_glm4, tmp_path / "onnx", target={"device": "onnx-cpu"})
    llm = LLM(out, device="cpu", max_num_seqs=2, max_num_batched_tokens=16)
    check_against_transformers(llm, tiny_glm4, PROMPTS, GREEDY, hf_greedy, hf_logits, hf_encode, 1e-4)


@pytest.mark.slow  # 2 ranks on the CPU
def test_tensor_parallel_matches_one_rank(tiny_glm4, artifact, tmp_path, hf_encode):
    """Two ranks, each with its heads' permuted q/k rows and biases."""
    from tests.runtime.hf_oracle import check_tensor_parallel

    check_tensor_parallel(tiny_glm4, artifact, tmp_path, hf_encode, PROMPTS, GREEDY)


def test_what_llmc_does_not_run_is_refused_by_name(tiny_glm4, artifact, tmp_path):
    """Export (the permuted q/k rows), run-time LoRA, importing a pre-quantized checkpoint, a partial rotary of an odd
    number of dims."""
    with pytest.raises(ArtifactError, match="Glm4ForCausalLM: the build permuted q_proj's and k_proj's rows out of"):
        export_artifact(artifact, tmp_path / "export")
    with pytest.raises(ConfigError, match=r"run-time LoRA does not run on Glm4ForCausalLM \(its q_proj and k_proj"):
        LLM(artifact, device="cpu", enable_lora=True)
    quantized = write_config(tiny_glm4, tmp_path / "gptq", quantization_config={
        "quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False})
    with pytest.raises(CheckpointError, match="quantization.method import is not supported for Glm4ForCausalLM"):
        build_import(quantized, tmp_path / "imported")
    odd = write_config(tiny_glm4, tmp_path / "odd", rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.3})
    with pytest.raises(CheckpointError, match="partial_rotary_factor 0.3 rotates 9 of head_dim 32's dims"):
        build_float32(odd, tmp_path / "odd-out")


# ---- Cohere 2 and Cohere ---------------------------------------------------------------------------------------

LOGIT_SCALE = 0.25  # tests/conftest.py's tiny Cohere 2 and Cohere


@pytest.fixture(scope="module")
def cohere2_artifact(tiny_cohere2, tmp_path_factory):
    return build_float32(tiny_cohere2, tmp_path_factory.mktemp("cohere2") / "a")


@torch.inference_mode()
@pytest.mark.parametrize("family", ["cohere2", "cohere"])
def test_cohere_logits_and_greedy_tokens_match_transformers(family, request, tmp_path, hf_greedy, hf_logits,
                                                            hf_encode):
    """60 positions prefilled in chunks of 16 (past Cohere 2's 8-token window), then greedy decoding of three prompts
    with continuous batching: the LayerNorms, the parallel block, the interleaved rotary (Cohere 2: on the sliding
    layers only) and the logit scale."""
    checkpoint = request.getfixturevalue(f"tiny_{family}")
    artifact = request.getfixturevalue("cohere2_artifact") if family == "cohere2" else \
        build_float32(checkpoint, tmp_path / "a")
    llm = LLM(artifact, device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64)
    check_against_transformers(llm, checkpoint, PROMPTS, GREEDY, hf_greedy, hf_logits, hf_encode, 1e-4)
    assert all(len(set(tokens)) > 10 for tokens in hf_greedy(checkpoint, PROMPTS, GREEDY.max_tokens))


@torch.inference_mode()
def test_cohere2_without_rotary_on_its_full_layer_is_what_transformers_computes(tiny_cohere2, cohere2_artifact,
                                                                                 hf_logits, hf_encode):
    """The full-attention layer rotates by nothing: the same artifact with the rope on every layer (the manifest's
    rope_on_full_layers true) is far from transformers."""
    import dataclasses

    from llmc.runtime.models.decoder import rope_tables

    model = read_manifest(cohere2_artifact).model
    assert (model.rope_on_full_layers, model.sliding_window_layers, model.rope_local_theta) == (False, [0, 2], 10000.0)
    everywhere, _ = rope_tables(dataclasses.replace(model, rope_on_full_layers=True), 64)
    table, local = rope_tables(model, 64)
    assert torch.equal(local, everywhere) and torch.equal(table[:, :8], torch.ones(64, 8)) and not table[:, 8:].any()
    token_ids = hf_encode(tiny_cohere2, PROMPTS[1]) + list(range(100, 140))
    llm = LLM(cohere2_artifact, device="cpu", max_num_batched_tokens=16)
    expected = hf_logits(tiny_cohere2, token_ids)
    llm.engine.runner.model.cos_sin.copy_(rope_tables(dataclasses.replace(model, rope_on_full_layers=True),
                                                      llm.engine.runner.model.cos_sin.shape[0])[0])
    moved = llm.engine.score(token_ids)
    assert (moved - expected).abs().mean() > 0.05 * expected.abs().mean()


def test_the_cohere2_artifact_holds_the_model_as_transformers_reads_it(tiny_cohere2, cohere2_artifact):
    """One norm per layer, the final norm times logit_scale, q/k rows permuted per head (whole heads), gate and up
    fused; the manifest's config, and the older sliding_window_pattern read as Cohere2Config reads it."""
    from transformers import AutoModelForCausalLM, Cohere2Config

    hf = load_file(tiny_cohere2 / "model.safetensors")
    ours = load_file(cohere2_artifact / "rank-00" / "weights.safetensors")
    torch.testing.assert_close(ours["norm.weight"], hf["model.norm.weight"] * LOGIT_SCALE, atol=0, rtol=0)
    perm = interleaved_rotary_permutation(16, 16)
    assert perm.tolist() == list(range(0, 16, 2)) + list(range(1, 16, 2))
    q = ours["layers.1.attn.qkv.weight"][:64]
    assert torch.equal(q, hf["model.layers.1.self_attn.q_proj.weight"].unflatten(0, (4, 16))[:, perm].flatten(0, 1))
    assert "layers.0.post_attn_norm.weight" not in ours and "lm_head.weight" not in ours
    assert torch.equal(ours["layers.0.input_norm.weight"], hf["model.layers.0.input_layernorm.weight"])
    model = read_manifest(cohere2_artifact).model
    assert (model.family, model.layer_norm, model.parallel_block, model.rotary_interleaved, model.rms_norm_eps,
            model.tie_word_embeddings) == ("cohere2", True, True, True, 1e-5, True)
    hf_model = AutoModelForCausalLM.from_pretrained(str(tiny_cohere2), dtype=torch.float32)
    assert model.num_parameters == sum(p.numel() for p in hf_model.parameters())
    saved = read_hf_config(tiny_cohere2)
    older = {k: v for k, v in saved.items() if k != "layer_types"}
    older |= {"num_hidden_layers": 6, "sliding_window_pattern": 3}
    theirs = Cohere2Config(**{k: v for k, v in older.items() if k not in ("architectures", "model_type")})
    ours = model_config_from_hf(older, cohere.SPEC2, "float32")
    assert ours.sliding_window_layers == [i for i, kind in enumerate(theirs.layer_types) if kind == "sliding_attention"]


@torch.inference_mode()
@pytest.mark.parametrize("quantization", [
    {"method": "rtn", "bits": 4, "group_size": 32},
    pytest.param({"method": "gptq", "bits": 4, "group_size": 32, "act_order": True}, marks=pytest.mark.slow),
    {"method": "awq", "bits": 4, "group_size": 32},
    pytest.param({"method": "fp8"}, marks=pytest.mark.slow),  # 2 s; tests/compiler covers FP8 linears
], ids=["rtn-w4", "gptq-w4-act-order", "awq-w4", "fp8"])
def test_quantized_builds_run_transformers_cohere2_on_their_weights(quantization, tiny_cohere2, tmp_path, data_dir,
                                                                    hf_encode):
    """Each build is transformers' Cohere2ForCausalLM holding its weights (q/k rows permuted back, the final norm
    divided by logit_scale). AWQ searches one scale for qkv and gate_up (both read input_norm) and one for down (o's
    inputs are not v's under grouped-query attention); act order's gathers stay the linears' own (the norm feeds
    two)."""
    out = build_quantized(tiny_cohere2, tmp_path, data_dir, quantization)
    _check_quantized_build(tiny_cohere2, out, hf_encode, quantization["method"], LOGIT_SCALE)


@pytest.mark.parametrize("family", ["cohere2", "glm4"])
def test_awq_folds_keep_the_function(family, request, tmp_path, data_dir, hf_encode, monkeypatch):
    """AWQ forced to fold random scales into W8 layers (every variant but round-to-nearest dropped), each a power of
    two from 1/4 to 4, one per group of 32 input columns: the groups' quantization scales take them exactly, so the
    build is the plain RTN W8 build's function if and only if every fold is undone where it is made. Cohere 2: one
    scale for qkv and gate_up, input_norm (a LayerNorm) divided once; GLM-4: input_norm and post_attn_norm, each
    followed by its linear, then the output norms."""
    checkpoint = request.getfixturevalue(f"tiny_{family}")
    searched = []
    awq, rtn = awq_and_rtn_logits(checkpoint, tmp_path, hf_encode(checkpoint, PROMPTS[1]) + list(range(100, 120)),
                                  monkeypatch, data_dir, searched)
    # per layer: Cohere 2 one search over qkv and gate_up, one for down; GLM-4 qkv, gate_up, down (o: GQA)
    assert searched == ([2, 1] * 3 if family == "cohere2" else [1, 1, 1] * 2)
    torch.testing.assert_close(awq, rtn, atol=1e-4, rtol=1e-4)


def test_the_triton_kernels_rotate_cohere2_as_transformers(tiny_cohere2, cohere2_artifact, hf_greedy, hf_logits,
                                                           hf_encode):
    """The GPU path on the CPU: the sliding layers rotate by the local table, the full one by cos 1, sin 0."""
    _check_triton_kernels(tiny_cohere2, cohere2_artifact, hf_greedy, hf_logits, hf_encode)


@pytest.mark.slow  # 2 ranks on the CPU
def test_cohere2_tensor_parallel_matches_one_rank(tiny_cohere2, cohere2_artifact, tmp_path, hf_encode):
    """Two ranks: the attention's and the MLP's partial sums all-reduced each, the LayerNorms on every rank."""
    from tests.runtime.hf_oracle import check_tensor_parallel

    check_tensor_parallel(tiny_cohere2, cohere2_artifact, tmp_path, hf_encode, PROMPTS, GREEDY)


@pytest.mark.parametrize("changes,recipe,message", [
    ({"use_qk_norm": True}, {}, "use_qk_norm"),
    ({"attention_bias": True}, {}, "attention_bias: true is not supported"),
    ({}, {"target": {"device": "onnx-cpu"}}, "LayerNorm and parallel attention \\+ MLP block are not exported to ONNX"),
    ({}, {"quantization": {"method": "int8", "smoothquant": 0.5, "report": False,
                           "calibration": {"num_samples": 2, "seq_len": 16}}}, "read one norm"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}},
     {"target": {"device": "cpu"}, "quantization": {"method": "import"}},
     "import is not supported for Cohere2ForCausalLM"),
], ids=["qk-norm", "attention-bias", "onnx", "smoothquant", "import"])
def test_what_llmc_does_not_run_on_cohere_is_refused_by_name(tiny_cohere2, tiny_cohere, tmp_path, data_dir, changes,
                                                              recipe, message):
    checkpoint = write_config(tiny_cohere if "use_qk_norm" in changes else tiny_cohere2, tmp_path / "ckpt", **changes)
    if "quantization" in recipe and "calibration" in recipe["quantization"]:
        recipe["quantization"]["calibration"]["data"] = str(data_dir / "calibration.txt")
    with pytest.raises((CheckpointError, RecipeError), match=message):
        build_float32(checkpoint, tmp_path / "out", **recipe)


def test_cohere2_export_and_run_time_lora_are_refused_by_name(cohere2_artifact, tmp_path):
    with pytest.raises(ArtifactError, match="Cohere2ForCausalLM: the build permuted q_proj's and k_proj's rows"):
        export_artifact(cohere2_artifact, tmp_path / "export")
    with pytest.raises(ConfigError, match=r"run-time LoRA does not run on Cohere2ForCausalLM"):
        LLM(cohere2_artifact, device="cpu", enable_lora=True)


# ---- on a GPU ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_float32_on_the_gpu_matches_transformers(tiny_glm4, artifact, hf_greedy, hf_logits, hf_encode, free_gpu):
    """The Triton kernels rotating whole heads by the head-wide table (decode, prefill, CUDA graphs)."""
    llm = LLM(artifact, device="cuda", gpu_memory_utilization=0.3, max_num_seqs=2, max_num_batched_tokens=16)
    check_against_transformers(llm, tiny_glm4, PROMPTS, GREEDY, hf_greedy, hf_logits, hf_encode, 2e-3)
    llm.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cohere2_float32_on_the_gpu_matches_transformers(tiny_cohere2, cohere2_artifact, hf_greedy, hf_logits,
                                                          hf_encode, free_gpu):
    """The LayerNorms in torch on CUDA, the parallel block inside the piecewise and decode CUDA graphs, the Triton
    kernels with the two tables."""
    llm = LLM(cohere2_artifact, device="cuda", gpu_memory_utilization=0.3, max_num_seqs=2, max_num_batched_tokens=16)
    check_against_transformers(llm, tiny_cohere2, PROMPTS, GREEDY, hf_greedy, hf_logits, hf_encode, 2e-3)
    llm.close()
