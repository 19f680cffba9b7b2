"""MTP speculative decoding of GLM-4.7-Flash (speculative method mtp): its multi-token-prediction layer, an MLA + MoE
decoder layer as DeepSeek-V3's (layer num_hidden_layers, which transformers' Glm4MoeLiteForCausalLM skips), kept by the
build (compiler/mtp.py) and run as DeepSeek-V3's is (runtime/mtp_head.py), on the tiny GLM-4.7-Flash of
tests/conftest.py (mlp_layer_types sparse / dense / sparse) with an MTP layer written under the published names
(test_spec_mtp._add_mtp_layer: layer 2's tensors plus noise, then enorm, hnorm, eh_proj, shared_head.norm).

References as test_spec_mtp_deepseek.py's: the engine's drafts equal the float64 reference of the published MTP
definition over transformers' float64 hidden states, its decoder layer transformers' own Glm4MoeLiteDecoderLayer
(layer 3 of a 4-layer copy, mlp_layer_types grown by a sparse layer); greedy and seeded outputs identical to decoding
without speculation; the model's own logits unchanged by the layer beside it; -m gpu: CUDA (written, not run)."""

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from safetensors.torch import load_file

from llmc.runtime.artifact import MTP_WEIGHTS, read_manifest
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from tests.conftest import make_hf_checkpoint
from tests.runtime.hf_oracle import build_float32
from tests.runtime.test_spec_mtp import (MAX_TOKENS, PROMPTS, Reference, _generate, _spec, build_mtp_artifacts,
                                         check_on_the_gpu, make_mtp_checkpoints)
from tests.runtime.test_spec_mtp_deepseek import check_drafts

N = 3  # the MTP layer's index


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """"shared": no shared_head.head nor embed_tokens; "bigram": its own, made a bigram predictor."""
    return make_mtp_checkpoints(tmp_path_factory.mktemp("mtp_glm_lite"), "glm4_moe_lite", {"shared": 5, "bigram": 6})


@pytest.fixture(scope="module")
def artifacts(checkpoints, tmp_path_factory):
    return build_mtp_artifacts(checkpoints, tmp_path_factory.mktemp("mtp_glm_lite_artifacts"))


@torch.inference_mode()
def test_the_build_keeps_the_mtp_layer_and_the_model_is_transformers(checkpoints, artifacts, tmp_path, caplog,
                                                                       hf_logits):
    """mtp/weights.safetensors holds the MLA + MoE layer (with its router bias) and the MTP tensors, the build says
    so; the model's logits are transformers' (which skips the layer) and a build without the layer's tensors'."""
    manifest = read_manifest(artifacts["bigram"])
    assert (manifest.model.family, manifest.model.num_layers, manifest.model.moe_layers) == ("glm4_moe_lite", N, [0, 2])
    assert (manifest.mtp.layer_index, manifest.mtp.is_moe, manifest.mtp.has_head) == (N, True, True)
    weights = load_file(artifacts["bigram"] / MTP_WEIGHTS)
    source = load_file(checkpoints["bigram"] / "model.safetensors")
    p = f"model.layers.{N}."
    for ours, theirs in (("attn.kv_b.weight", "self_attn.kv_b_proj.weight"), ("moe.gate.weight", "mlp.gate.weight"),
                         ("moe.gate_bias.weight", "mlp.gate.e_score_correction_bias")):
        assert torch.equal(weights[f"layers.{N}.{ours}"], source[p + theirs]), ours
    assert torch.equal(weights["eh_proj.weight"], source[p + "eh_proj.weight"])
    token_ids = list(range(100, 130))
    plain = make_hf_checkpoint(tmp_path / "plain", "glm4_moe_lite")  # (its config names the layer, no tensors)
    with caplog.at_level("INFO", logger="llmc"):
        plain_artifact = build_float32(plain, tmp_path / "plain-art")
    assert "GLM-4.7-Flash: config num_nextn_predict_layers is 1 but the checkpoint has no" in caplog.text
    assert read_manifest(plain_artifact).mtp is None
    with LLM(artifacts["shared"], device="cpu", num_kv_blocks=64) as llm:
        got = llm.engine.score(token_ids)
    torch.testing.assert_close(got, hf_logits(checkpoints["shared"], token_ids), atol=1e-4, rtol=1e-4)


def test_drafts_equal_the_float64_reference(checkpoints, artifacts, tmp_path):
    """Every verify step's drafts (k = 2, chained) equal the float64 reference's over Glm4MoeLiteDecoderLayer, under
    chunked prefill and preemption."""
    check_drafts(artifacts["bigram"], Reference(checkpoints["bigram"], tmp_path))


@pytest.mark.slow  # (the default run checks this layer's drafts against float64 above, and MTP's engine in test_spec_mtp)
def test_greedy_and_seeded_samples_equal_decoding_without_speculation(artifacts):
    """Greedy and seeded requests batched, k = 2 under chunked prefill and preemption: the same tokens as without
    speculation, every block freed; the bigram layer's drafts are accepted often."""
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)] * 4
    params += [SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=11, ignore_eos=True)] * 2
    plain, _ = _generate(artifacts["bigram"], PROMPTS, params)
    got, stats = _generate(artifacts["bigram"], PROMPTS, params, speculative=_spec(2), max_num_batched_tokens=24,
                           num_kv_blocks=6)
    assert got == plain
    assert stats["num_preemptions"] > 0 and stats["num_spec_accepted"] > 0.2 * stats["num_spec_proposed"], stats


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu(artifacts, free_gpu):
    """On CUDA (the model's CUDA graphs, the head eager over its latent cache): greedy tokens as without speculation."""
    check_on_the_gpu(artifacts["bigram"])
