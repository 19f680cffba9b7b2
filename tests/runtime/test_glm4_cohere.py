"""GLM-4 (Glm4ForCausalLM) against transformers' own model (float32): its interleaved partial rotary against
transformers' apply_rotary_pos_emb, logits over chunked prefill and greedy decoding on the CPU, the Triton rotary,
KV-write and attention kernels in Triton's interpreter, the onnx-cpu graph, quantized builds against transformers
holding their dequantized weights, how the config is read, the artifact, and every refusal. (Cohere 2 is not
supported yet: its refusal is here too.)"""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from llmc.compiler.export import export_artifact
from llmc.compiler.hf_checkpoint import interleaved_rotary_permutation, model_config_from_hf, read_hf_config
from llmc.errors import ArtifactError, CheckpointError, ConfigError
from llmc.runtime.artifact import read_manifest
from llmc.runtime.layers.rotary import cos_sin_cache
from llmc.runtime.llm import LLM
from llmc.runtime.models import glm4
from llmc.runtime.sampling_params import SamplingParams
from tests.conftest import REPO_ROOT
from tests.runtime.hf_oracle import build_float32, build_import, check_against_transformers, write_config

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
    assert manifest.format_version == "1.21"


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


def _hf_state_of(artifact) -> dict[str, torch.Tensor]:
    """The artifact's weights as Glm4ForCausalLM's state dict: each linear dequantized by the formats' oracle
    (quant/reference.py), q/k rows (and biases) permuted back to GLM's interleaved layout, qkv split into q/k/v."""
    from llmc.quant.formats import make_format
    from llmc.quant.reference import dequantize

    manifest = json.loads((artifact / "manifest.json").read_text())
    model = manifest["model"]
    tensors = load_file(artifact / "rank-00" / "weights.safetensors")
    inverse = torch.argsort(interleaved_rotary_permutation(model["head_dim"], model["rotary_dim"]))

    def unpermute(rows):
        return rows.unflatten(0, (-1, model["head_dim"]))[:, inverse].flatten(0, 1)

    state = {"model.embed_tokens.weight": tensors["embed.weight"], "model.norm.weight": tensors["norm.weight"],
             "lm_head.weight": tensors["lm_head.weight"]}
    names = {"attn.o": "self_attn.o_proj", "mlp.gate_up": "mlp.gate_up_proj", "mlp.down": "mlp.down_proj"}
    for i in range(model["num_layers"]):
        layer = f"model.layers.{i}."
        for runtime, hf in glm4.GLM4_NORMS.items():
            state[f"{layer}{hf}.weight"] = tensors[f"layers.{i}.{runtime}.weight"]
        for runtime in ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down"):
            prefix = f"layers.{i}.{runtime}."
            params = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix) and k != prefix + "bias"}
            weight = dequantize(make_format(manifest["quant"]["modules"][prefix[:-1]], torch.float32), params).float()
            if runtime != "attn.qkv":
                state[f"{layer}{names[runtime]}.weight"] = weight
                continue
            bias = tensors[prefix + "bias"].float()
            for kind, whole in (("weight", weight), ("bias", bias)):
                q, k, v = whole.split([128, 64, 64])
                state |= {f"{layer}self_attn.q_proj.{kind}": unpermute(q), f"{layer}self_attn.k_proj.{kind}": unpermute(k),
                          f"{layer}self_attn.v_proj.{kind}": v}
    return state


@torch.inference_mode()
@pytest.mark.parametrize("quantization", [
    {"method": "rtn", "bits": 4, "group_size": 32},
    pytest.param({"method": "gptq", "bits": 4, "group_size": 32}, marks=pytest.mark.slow),  # RTN's path, calibrated
    {"method": "awq", "bits": 4, "group_size": 32},
    {"method": "fp8"},
], ids=["rtn-w4", "gptq-w4", "awq-w4", "fp8"])
def test_quantized_builds_run_transformers_glm4_on_their_weights(quantization, tiny_glm4, tmp_path, data_dir,
                                                                 hf_encode):
    """Each build is transformers' Glm4ForCausalLM holding the artifact's weights dequantized (FP8: each decoder
    linear's input rounded to E4M3 per token, as its dynamic activations are): logits over 40 positions and 16 greedy
    tokens. AWQ's folds apply as for Gemma (a norm before qkv and gate_up, v before o, up before down)."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import fp8_per_token

    calibration = {"data": str(data_dir / "calibration.txt"), "num_samples": 4, "seq_len": 32}
    out = build_float32(tiny_glm4, tmp_path / "q", target={"device": "cpu"}, quantization={
        **quantization, "report": False, **({"calibration": calibration} if quantization["method"] != "rtn" and
                                            quantization["method"] != "fp8" else {})})
    assert read_manifest(out).quant.modules["layers.0.attn.qkv"]["format"] != "dense"
    oracle = AutoModelForCausalLM.from_pretrained(str(tiny_glm4), dtype=torch.float32, attn_implementation="eager")
    missing, unexpected = oracle.load_state_dict(_hf_state_of(out), strict=True)
    oracle.eval()
    if quantization["method"] == "fp8":
        for name, module in oracle.named_modules():
            if name.startswith("model.layers.") and isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(lambda _, args: (fp8_per_token(args[0]),))
    token_ids = hf_encode(tiny_glm4, PROMPTS[1]) + list(range(100, 120))
    llm = LLM(out, device="cpu", max_num_batched_tokens=16)
    torch.testing.assert_close(llm.engine.score(token_ids), oracle(torch.tensor([token_ids])).logits[0],
                               atol=1e-4, rtol=1e-4)
    prompt = hf_encode(tiny_glm4, PROMPTS[0])
    want = oracle.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                           max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
    got = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=16))
    assert got[0].outputs[0].token_ids == want


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


def test_the_triton_kernels_rotate_glm4_as_transformers(tiny_glm4, artifact, hf_greedy, hf_logits, hf_encode):
    """The GPU path on the CPU: the rotary + KV-write kernel (prefill chunks of 16) and the decode kernel's fused
    rotary, in Triton's interpreter, over the head-wide table: transformers' greedy tokens and logits."""
    prompts = [hf_encode(tiny_glm4, p) for p in PROMPTS[:2]]
    scored = hf_encode(tiny_glm4, PROMPTS[1]) + list(range(100, 120))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT)}
    run = subprocess.run([sys.executable, "-c", TRITON_SCRIPT, str(artifact), json.dumps(prompts), json.dumps(scored)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    calls, tokens, logits = json.loads(run.stdout.strip().splitlines()[-1])
    assert calls["write"] > 0 and calls["fused"] > 0
    assert tokens == hf_greedy(tiny_glm4, PROMPTS[:2], 6)
    torch.testing.assert_close(torch.tensor(logits), hf_logits(tiny_glm4, scored), atol=1e-4, rtol=1e-4)


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
    number of dims, and Cohere 2 (not supported yet)."""
    with pytest.raises(ArtifactError, match="Glm4ForCausalLM: the build permuted q_proj's and k_proj's rows out of its interleaved rotary"):
        export_artifact(artifact, tmp_path / "export")
    with pytest.raises(ConfigError, match=r"run-time LoRA does not run on Glm4ForCausalLM \(its q_proj and k_proj rows"):
        LLM(artifact, device="cpu", enable_lora=True)
    quantized = write_config(tiny_glm4, tmp_path / "gptq", quantization_config={
        "quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False})
    with pytest.raises(CheckpointError, match="quantization.method import is not supported for Glm4ForCausalLM"):
        build_import(quantized, tmp_path / "imported")
    odd = write_config(tiny_glm4, tmp_path / "odd", rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.3})
    with pytest.raises(CheckpointError, match="partial_rotary_factor 0.3 rotates 9 of head_dim 32's dims"):
        build_float32(odd, tmp_path / "odd-out")
    cohere = write_config(tiny_glm4, tmp_path / "cohere", architectures=["Cohere2ForCausalLM"], model_type="cohere2")
    with pytest.raises(CheckpointError, match="architecture Cohere2ForCausalLM: Cohere 2"):
        build_float32(cohere, tmp_path / "cohere-out")


# ---- on a GPU ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_float32_on_the_gpu_matches_transformers(tiny_glm4, artifact, hf_greedy, hf_logits, hf_encode, free_gpu):
    """The Triton kernels rotating whole heads by the head-wide table (decode, prefill, CUDA graphs)."""
    llm = LLM(artifact, device="cuda", gpu_memory_utilization=0.3, max_num_seqs=2, max_num_batched_tokens=16)
    check_against_transformers(llm, tiny_glm4, PROMPTS, GREEDY, hf_greedy, hf_logits, hf_encode, 2e-3)
    llm.close()
