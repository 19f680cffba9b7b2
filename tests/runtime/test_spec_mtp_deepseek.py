"""MTP speculative decoding of DeepSeek-V3 (speculative method mtp): its multi-token-prediction layer, an MLA + MoE
decoder layer, kept by the build (compiler/mtp.py) and run as a draft head with its own one-layer latent KV cache
(runtime/mtp_head.py, runtime/spec_eagle.py).

The tiny random DeepseekV3ForCausalLM of tests/conftest.py (3 layers: 1 dense, 2 MoE; MLA with a q_lora_rank, the
interleaved rope, YaRN with its mscale terms) with an MTP layer as DeepSeek-V3 publishes it, model.layers.3.*:
transformers' save_pretrained drops it, so the test writes its tensors under the published names (test_spec_mtp's
_add_mtp_layer: layer 2's tensors plus noise — q_a / q_a_layernorm / q_b, kv_a_proj_with_mqa / kv_a_layernorm / kv_b,
o, the router with its e_score_correction_bias, the experts and shared experts — then enorm, hnorm, eh_proj,
shared_head.norm, and shared_head.head / embed_tokens where a case has them).

References: (a) the engine's drafts (first and chained) equal a float64 reference of the published MTP definition over
transformers' float64 hidden states, its decoder layer transformers' own DeepseekV3DecoderLayer (layer 3 of a 4-layer
copy of the checkpoint: test_spec_mtp.Reference), under chunked prefill and preemption; (b) greedy and seeded outputs
identical to decoding without speculation, every KV block freed; (c) with k = 1 the accepted drafts, counted, equal
what the reference's predictions accept along the greedy tokens (a bigram-predicting layer), a random layer's hardly
ever; (d) the head's latent cache has MLA's shape and the CPU memory plan counts it; (e) an import of the MTP layer in
block FP8 (DeepSeek-V3 / R1's published format: E4M3 and weight_scale_inv per block, written here by the published
rule, test_fp8_block_import.quantize_blocks) holds the float64 dequantization of its weights, and its drafts equal the
reference's on those weights. Also: the Triton kernels (interpreted) in the head, the refusals and what is left out;
-m gpu: CUDA (not yet run)."""

import json
import os
import shutil

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ConfigError
from llmc.runtime.artifact import MTP_WEIGHTS, read_manifest
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from tests.conftest import make_hf_checkpoint
from tests.runtime.hf_oracle import build_import
from tests.runtime.test_deepseek import triton_dispatch  # noqa: F401 (a fixture)
from tests.runtime.test_spec_mtp import (MAX_TOKENS, PROMPTS, Reference, _generate, _record_drafts, _spec,
                                         build_mtp_artifacts, check_accepted_as_the_reference, check_on_the_gpu,
                                         check_the_head_runs_a_kernel, make_mtp_checkpoints)

N, LATENT = 3, 32 + 4  # the MTP layer's index; kv_lora_rank + qk_rope_head_dim of the tiny config


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """"shared": no shared_head.head nor embed_tokens (the model's lm_head and embedding); "bigram": its own, made a
    bigram predictor of the greedy continuations (test_spec_mtp._make_it_a_bigram_predictor)."""
    return make_mtp_checkpoints(tmp_path_factory.mktemp("mtp_deepseek"), "deepseek_v3", {"shared": 4, "bigram": 3})


@pytest.fixture(scope="module")
def artifacts(checkpoints, tmp_path_factory):
    return build_mtp_artifacts(checkpoints, tmp_path_factory.mktemp("mtp_deepseek_artifacts"))


def test_the_build_keeps_the_mla_mtp_layer(checkpoints, artifacts, tmp_path, caplog):
    """mtp/weights.safetensors holds the MLA decoder layer in the runtime's names, as the checkpoint has its tensors
    (kv_b whole: the runtime splits it at load), the MTP tensors, and the manifest says which."""
    manifest = read_manifest(artifacts["bigram"])
    assert manifest.format_version == "1.47" and manifest.model.num_layers == N and manifest.model.is_mla
    assert (manifest.mtp.layer_index, manifest.mtp.is_moe, manifest.mtp.has_head, manifest.mtp.has_embed) == (
        N, True, True, True)
    weights = load_file(artifacts["bigram"] / MTP_WEIGHTS)
    source = load_file(checkpoints["bigram"] / "model.safetensors")
    p = f"model.layers.{N}."
    for ours, theirs in (("attn.q_a", "self_attn.q_a_proj"), ("attn.q_b", "self_attn.q_b_proj"),
                         ("attn.kv_a", "self_attn.kv_a_proj_with_mqa"), ("attn.kv_b", "self_attn.kv_b_proj"),
                         ("attn.o", "self_attn.o_proj"), ("attn.q_a_norm", "self_attn.q_a_layernorm"),
                         ("attn.kv_a_norm", "self_attn.kv_a_layernorm"), ("moe.gate", "mlp.gate")):
        assert torch.equal(weights[f"layers.{N}.{ours}.weight"], source[f"{p}{theirs}.weight"]), ours
    assert torch.equal(weights[f"layers.{N}.moe.gate_bias.weight"], source[p + "mlp.gate.e_score_correction_bias"])
    for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head"):
        assert torch.equal(weights[f"{name}.weight"], source[f"{p}{name}.weight"])
    assert torch.equal(weights["embed.weight"], source[p + "embed_tokens.weight"])
    assert not [name for name in load_file(artifacts["bigram"] / "rank-00" / "weights.safetensors")
                if name.startswith(f"layers.{N}.")]
    assert not load_file(artifacts["shared"] / MTP_WEIGHTS).keys() & {"embed.weight", "shared_head.head.weight"}
    with caplog.at_level("INFO", logger="llmc"):
        build(recipe_from_dict({"model": str(checkpoints["shared"]), "output": str(tmp_path / "again"),
                                "dtype": "float32"}), show_progress=False)
    assert ("DeepSeek-V3: the multi-token prediction layer (layer 3) is built into mtp/weights.safetensors"
            in caplog.text)


def test_the_head_has_a_latent_cache_and_the_memory_plan_counts_it(artifacts):
    """The head's cache is one latent [num_blocks + 1, block_size, kv_lora_rank + qk_rope_head_dim] (its scratch
    block beside the model's), not GQA's K and V; cpu_kv_cache_gib holds the model's 3 latent layers and the head's
    one, so the engine gets 3/4 of the blocks it gets without speculation (to the block)."""
    gib = 0.0005
    with LLM(artifacts["shared"], device="cpu", cpu_kv_cache_gib=gib, speculative=_spec(2)) as llm:
        head, blocks = llm.engine.proposer.head, llm.stats()["num_total_blocks"]
        block_size = llm.engine.options.block_size
        assert [tuple(t.shape) for t in head.kv_cache] == [(blocks + 1, block_size, LATENT)]
        assert head.layer.attn.kv_cache is head.kv_cache and head.layer.attn.w_uk.shape == (4, 12, 32)
    with LLM(artifacts["shared"], device="cpu", cpu_kv_cache_gib=gib) as plain:
        plain_blocks = plain.stats()["num_total_blocks"]
    budget = int(gib * 2**30)
    assert plain_blocks == budget // (N * LATENT * 4 * block_size)
    assert blocks == budget // ((N + 1) * LATENT * 4 * block_size)


@pytest.mark.parametrize("kind", ["shared", "bigram"])
def test_drafts_equal_the_float64_reference(checkpoints, artifacts, kind, tmp_path):
    """Every verify step's drafts (k = 2: the first from the model's hidden state, the second chained on the head's
    own output) equal the float64 reference's over DeepseekV3DecoderLayer, under chunked prefill and preemption:
    holds only if the head's latent cache holds the right rows at every step."""
    check_drafts(artifacts[kind], Reference(checkpoints[kind], tmp_path))


def check_drafts(artifact, reference) -> None:
    llm = LLM(artifact, device="cpu", max_num_seqs=4, disable_log_stats=True, max_num_batched_tokens=24,
              num_kv_blocks=6, speculative=_spec(2))
    seen = _record_drafts(llm)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert llm.stats()["num_preemptions"] > 0
    agree = sum(reference.drafts(list(tokens), len(drafts)) == drafts for tokens, drafts in seen.items())
    assert len(seen) > 30
    assert agree >= 0.95 * len(seen), (agree, len(seen))  # float32 against float64: a near-tie may flip


def _fp8_mtp_layer(source, dest, dense, block: int) -> dict[str, torch.Tensor]:
    """`source` as DeepSeek-V3 publishes its MTP layer: every linear of layer 3 (MLA's, the experts', the shared
    experts', eh_proj) in `block` x `block` FP8 (`quant_method: fp8`, weight_scale_inv), the router dense; the main
    layers left dense (modules_to_not_convert) so that the reference's hidden states are the model's. `dense`: the
    same checkpoint holding the published dequantization (float64, rounded once to float32). Returns it by name."""
    from tests.quant.test_fp8_block_import import HF_FP8, dequantized, quantize_blocks

    shutil.copytree(source, dest)
    shutil.copytree(source, dense)
    tensors, expected = load_file(source / "model.safetensors"), {}
    linears = ("proj.weight", "proj_with_mqa.weight")
    for name in [n for n in tensors if n.startswith(f"model.layers.{N}.") and n.endswith(linears)]:
        levels, scales = quantize_blocks(tensors[name], (block, block))
        expected[name] = dequantized(levels, scales, (block, block))
        tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = levels, scales
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    save_file(load_file(source / "model.safetensors") | expected, dense / "model.safetensors",
              metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config["quantization_config"] = {**HF_FP8, "weight_block_size": [block, block],
                                     "modules_to_not_convert": [rf"model\.layers\.[0-{N - 1}]\."]}
    (dest / "config.json").write_text(json.dumps(config))
    return expected


@pytest.mark.parametrize("block", [128, 16])
def test_an_fp8_import_builds_the_dequantized_mtp_layer(checkpoints, block, tmp_path, caplog):
    """An import of the MTP layer in block FP8 (128: the published blocks, each tensor here one partial block; 16:
    kv_a's 36 rows and the experts' 24 in partial blocks) writes it dense: its linears equal the float64 dequantization
    of the checkpoint's levels and scales, the whole file equals a float build's of the dequantized checkpoint, and
    (16) every verify step's drafts equal the float64 reference's on the dequantized weights."""
    expected = _fp8_mtp_layer(checkpoints["bigram"], tmp_path / "fp8", tmp_path / "dense", block)
    assert len(expected) > 10 and any(t.shape[0] % block for t in expected.values())
    with caplog.at_level("INFO", logger="llmc"):
        artifact = build_import(tmp_path / "fp8", tmp_path / "fp8-art", runtime={"max_model_len": 64})
    assert (f"DeepSeek-V3: the checkpoint's multi-token prediction layer is FP8 ({len(expected)} weights" in caplog.text
            and "dequantized with its scales" in caplog.text)
    assert read_manifest(artifact).mtp.has_head
    weights, p = load_file(artifact / MTP_WEIGHTS), f"model.layers.{N}."
    for ours, theirs in (("attn.q_a", "self_attn.q_a_proj"), ("attn.q_b", "self_attn.q_b_proj"),
                         ("attn.kv_a", "self_attn.kv_a_proj_with_mqa"), ("attn.kv_b", "self_attn.kv_b_proj"),
                         ("attn.o", "self_attn.o_proj")):
        assert torch.equal(weights[f"layers.{N}.{ours}.weight"], expected[f"{p}{theirs}.weight"]), ours
    assert torch.equal(weights["eh_proj.weight"], expected[p + "eh_proj.weight"])
    dense = build_mtp_artifacts({"dense": tmp_path / "dense"}, tmp_path / "built")["dense"]
    reference = load_file(dense / MTP_WEIGHTS)
    assert weights.keys() == reference.keys()
    assert all(torch.equal(weights[name], reference[name]) for name in weights)
    if block == 16:
        check_drafts(artifact, Reference(tmp_path / "dense", tmp_path))


def test_greedy_and_seeded_samples_equal_decoding_without_speculation(artifacts):
    """Greedy, seeded and n=2 requests batched, k = 2 under chunked prefill and preemption: the same tokens as without
    speculation, every block freed; the bigram layer's drafts are accepted often."""
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)] * 4
    params += [SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=11, ignore_eos=True),
               SamplingParams(temperature=0.8, top_p=0.9, n=2, max_tokens=MAX_TOKENS, seed=5, ignore_eos=True)]
    plain, _ = _generate(artifacts["bigram"], PROMPTS, params)
    got, stats = _generate(artifacts["bigram"], PROMPTS, params, speculative=_spec(2), max_num_batched_tokens=24,
                           num_kv_blocks=6)
    assert got == plain
    assert stats["num_preemptions"] > 0 and stats["num_spec_accepted"] > 0.2 * stats["num_spec_proposed"], stats


def test_accepted_drafts_are_the_references(checkpoints, artifacts, tmp_path):
    """k = 1, greedy: a draft is accepted iff it is the greedy token, so along each request's greedy tokens the engine
    accepts exactly where the float64 reference's draft is the next token (a verify step skips a token after each
    acceptance). The bigram layer's drafts are accepted often, the random layer's hardly ever."""
    check_accepted_as_the_reference(artifacts["bigram"], Reference(checkpoints["bigram"], tmp_path), artifacts["shared"])


def test_the_triton_path_gives_the_same_tokens(artifacts, triton_dispatch):  # noqa: F811
    """The kernels CUDA runs (the absorbed latent attention over the paged latent cache, the fused MoE: Triton's
    interpreter on CPU tensors) in the model and the MTP head alike: greedy tokens as without speculation, the bigram
    layer's drafts accepted, and the head's own attention steps through the latent kernel."""
    check_the_head_runs_a_kernel(artifacts["bigram"], triton_dispatch, lambda layer: layer.attn, "attend",
                                 "mla_attention")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu(artifacts, free_gpu):
    """On CUDA (the model's CUDA graphs, the head eager over its latent cache): greedy tokens as without speculation."""
    check_on_the_gpu(artifacts["bigram"])


def test_what_is_refused_or_left_out(checkpoints, tmp_path, caplog):
    """DeepSeek-V2 ships no MTP layer: method mtp is refused by name; a DeepSeek-V3 config that names one without its
    tensors builds without it, and so does an import whose MTP layer is in integers (here int8: W8A8's levels), not
    FP8 (logged, refused by name at run time)."""
    from tests.runtime.test_deepseek import _write_block_fp8

    _write_block_fp8(checkpoints["shared"], tmp_path / "int8")
    path = tmp_path / "int8" / "model.safetensors"
    save_file({name: t.view(torch.int8) if name.startswith(f"model.layers.{N}.") and t.dtype == torch.float8_e4m3fn
               else t for name, t in load_file(path).items()}, path, metadata={"format": "pt"})
    with caplog.at_level("INFO", logger="llmc"):
        build_import(tmp_path / "int8", tmp_path / "int8-art")
    assert ("DeepSeek-V3: the checkpoint's multi-token prediction layer is quantized (model.layers.3." in caplog.text
            and "not in FP8 with its scales; it is not built from an import" in caplog.text)
    with pytest.raises(ConfigError, match=r"holds no multi-token-prediction layer \(it was built by "
                                          r"quantization.method import: its checkpoint has none, or one in integers"):
        LLM(tmp_path / "int8-art", device="cpu", speculative=_spec())
    v2 = make_hf_checkpoint(tmp_path / "v2", "deepseek_v2")
    build(recipe_from_dict({"model": str(v2), "output": str(tmp_path / "v2-art"), "dtype": "float32"}),
          show_progress=False)
    with pytest.raises(ConfigError, match=r"speculative method mtp: this artifact \(DeepseekV2ForCausalLM\) holds no "
                                          r"multi-token-prediction layer \(llmc builds GLM-4.5's"):
        LLM(tmp_path / "v2-art", device="cpu", speculative=_spec())
    plain = make_hf_checkpoint(tmp_path / "v3", "deepseek_v3")  # (its config's num_nextn_predict_layers: 1)
    with caplog.at_level("INFO", logger="llmc"):
        build(recipe_from_dict({"model": str(plain), "output": str(tmp_path / "v3-art"), "dtype": "float32"}),
              show_progress=False)
    assert ("DeepSeek-V3: config num_nextn_predict_layers is 1 but the checkpoint has no model.layers.3.enorm"
            in caplog.text)
    assert read_manifest(tmp_path / "v3-art").mtp is None
