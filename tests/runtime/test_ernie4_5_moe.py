"""ERNIE 4.5 MoE (Ernie4_5_MoeForCausalLM) against transformers' own model (float32, the tiny random checkpoint of
tests/conftest.py: 4 layers, 1 and 3 MoE by moe_layer_interval 2 from moe_layer_start_index 1, 0 and 2 dense; 8
experts, top 2, 2 shared; tied embeddings; interleaved rotary): logits over a chunked prefill and greedy tokens of a
batch on the CPU path and on the Triton path (attention and fused-MoE kernels under TRITON_INTERPRET=1); its router
against transformers' Ernie4_5_MoeTopKRouter; RTN and GPTQ W4 builds against transformers holding their dequantized
weights; a bfloat16 build's float32 router; tensor parallelism; which layers are MoE as transformers decides; the
refusals. The checkpoint's moe_statics bias is random (_randomise_), and the logits move without it, so the biased
choice is checked."""

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (triton reads it then)

import pytest
import torch
from safetensors.torch import load_file

from llmc.compiler.build import build
from llmc.compiler.export import export_artifact
from llmc.compiler.hf_checkpoint import model_config_from_hf, read_hf_config
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ArtifactError, CheckpointError, RecipeError
from llmc.runtime.artifact import FORMAT_VERSION, read_manifest
from llmc.runtime.llm import LLM
from llmc.runtime.models import spec_for_architecture
from llmc.runtime.models.moe import deepseek_route
from llmc.runtime.sampling_params import SamplingParams
from tests.conftest import make_hf_checkpoint
from tests.runtime.hf_oracle import (MOE_QUANTIZATIONS_TIED, MOE_QUANTIZATION_IDS, assert_same_routes, build_float32,
                                     build_quantized, check_against_transformers, check_moe_build_as_oracle,
                                     moe_hf_state, write_config)
from tests.runtime.test_glm4_moe import triton_dispatch  # noqa: F401 (a fixture)

PROMPTS = ["ROMEO:", "What light through yonder window breaks? It is the east", "In the beginning"]
GREEDY = SamplingParams(temperature=0, max_tokens=16)
ENGINE = {"device": "cpu", "max_num_seqs": 2, "max_num_batched_tokens": 16, "num_kv_blocks": 64}
ARCH = "Ernie4_5_MoeForCausalLM"
SCORE_BIAS = "mlp.gate.moe_statics.e_score_correction_bias"  # transformers' in-memory name, [1, num_experts]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("ernie4_5_moe") / "ckpt", "ernie4_5_moe")


@pytest.fixture(scope="module")
def artifact(checkpoint, tmp_path_factory):
    return build_float32(checkpoint, tmp_path_factory.mktemp("ernie4_5_moe_artifact") / "f32")


@torch.inference_mode()
def test_logits_and_greedy_match_transformers(checkpoint, artifact, hf_greedy, hf_logits, hf_encode):
    """Logits at 52 positions prefilled in chunks of 16 (1e-4) and 16 greedy tokens of three prompts batched two at a
    time: transformers' float32 model's. The manifest: the family, its MoE layers, the router's fields."""
    manifest = read_manifest(artifact)
    m = manifest.model
    assert manifest.format_version == FORMAT_VERSION == "1.47"
    assert (m.family, m.moe_layers, m.num_experts, m.num_experts_per_tok, m.shared_expert_intermediate_size,
            m.shared_expert_gate, m.router_scoring, m.router_norm_min, m.router_score_bias, m.router_in_float32,
            m.norm_topk_prob, m.rotary_interleaved, m.tie_word_embeddings) == (
        "ernie4_5_moe", [1, 3], 8, 2, 64, False, "softmax", 1e-12, True, True, True, True, True)
    assert all(len(set(tokens)) > 3 for tokens in hf_greedy(checkpoint, PROMPTS, 16))  # not one token repeated
    with LLM(artifact, **ENGINE) as llm:
        check_against_transformers(llm, checkpoint, PROMPTS, GREEDY, hf_greedy, hf_logits, hf_encode, 1e-4)


@torch.inference_mode()
def test_the_score_bias_changes_the_choice(checkpoint, artifact, hf_encode):
    """The checkpoint's moe_statics bias is not zero, and transformers' model with it zeroed gives other logits than
    the artifact (which matched it with the bias: above), so the runtime chooses with it."""
    from transformers import AutoModelForCausalLM

    tensors = load_file(checkpoint / "model.safetensors")
    biases = [t for name, t in tensors.items() if name.endswith("moe_statics.e_score_correction_bias")]
    assert len(biases) == 2 and all(b.shape == (1, 8) and b.abs().min() > 0 for b in biases)
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32, attn_implementation="eager")
    for layer in (1, 3):
        model.model.layers[layer].mlp.gate.moe_statics.e_score_correction_bias.zero_()
    token_ids = hf_encode(checkpoint, PROMPTS[1]) + list(range(100, 140))
    with LLM(artifact, **ENGINE) as llm:
        got = llm.engine.score(token_ids)
    assert (model(torch.tensor([token_ids])).logits[0] - got).abs().max() > 1e-2


@torch.inference_mode()
def test_the_triton_path_matches_transformers(checkpoint, artifact, triton_dispatch, hf_greedy, hf_logits,  # noqa: F811
                                              hf_encode):
    """The rotary + KV-write and attention kernels (the permuted rows over the whole-head table) and the fused MoE
    kernel (the biased softmax router's ids and weights): transformers' logits and greedy tokens."""
    with LLM(artifact, **ENGINE) as llm:
        check_against_transformers(llm, checkpoint, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6),
                                   hf_greedy, hf_logits, hf_encode, 1e-4)
    assert triton_dispatch["rotate_and_write_kv"] and triton_dispatch["fused_moe"]


def test_the_router_is_transformers_router():
    """deepseek_route (softmax, chosen by softmax + bias, no groups, renormalised by max(sum, norm_min)) against
    transformers' Ernie4_5_MoeTopKRouter on 512 random tokens: the same experts, the same weights; with a norm_min
    that binds (0.6 over top-3 of 16) too."""
    from transformers import Ernie4_5_MoeConfig
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 32, generator=gen)
    for norm_min, bias_std in ((1e-12, 0.1), (0.6, 0.3)):
        config = Ernie4_5_MoeConfig(hidden_size=32, moe_num_experts=16, moe_k=3, moe_norm_min=norm_min)
        router = Ernie4_5_MoeTopKRouter(config)
        torch.nn.init.normal_(router.weight, generator=gen)
        bias = router.moe_statics.e_score_correction_bias
        bias.data.copy_(bias_std * torch.randn(bias.shape, generator=gen))
        with torch.no_grad():
            logits, want_weights, want_ids = router(x)
        weights, ids = deepseek_route(logits, 3, "softmax", bias.reshape(-1), None, None, True, 1.0, norm_min)
        assert not torch.equal(ids.sort().values, logits.topk(3).indices.sort().values)  # the bias changes choices
        if norm_min == 0.6:
            assert (want_weights.sum(-1) < 0.999).any()  # the floor binds on some tokens
        assert_same_routes(weights, ids, want_weights, want_ids)


@torch.inference_mode()
@pytest.mark.parametrize("quantization", MOE_QUANTIZATIONS_TIED, ids=MOE_QUANTIZATION_IDS)
def test_a_quantized_build_runs_transformers_on_its_weights(quantization, checkpoint, tmp_path, hf_encode, data_dir):
    """A W4A16 build (qkv, o, the dense MLPs, the shared experts and every expert; GPTQ and AWQ calibrated through the
    MoE layers) and an FP8 one (its linears; each input rounded to E4M3 per token in transformers too) against
    transformers' model holding its dequantized weights (q/k rows permuted back, the float32 router and its bias as
    built): logits (1e-4; FP8 1e-3: one of the 34 positions is 3e-4 off, the others within 1e-5, as one activation
    rounded to the other E4M3 neighbour at a near-tie would make it) and greedy tokens."""
    out = build_quantized(checkpoint, tmp_path, data_dir, quantization)
    modules = read_manifest(out).quant.modules
    fp8 = quantization["method"] == "fp8"
    assert {modules[f"layers.{i}.{name}"]["format"] for i, name in (
        (0, "attn.qkv"), (0, "mlp.down"), (1, "moe.shared.gate_up"))} == {"w8a8-fp8" if fp8 else "w4a16"}
    assert {modules[f"layers.{i}.moe.experts.{name}"]["format"] for i, name in ((1, "gate_up"), (3, "down"))} == {
        "dense" if fp8 else "w4a16"}
    check_moe_build_as_oracle(out, checkpoint, moe_hf_state(out, SCORE_BIAS, (1, -1)), hf_encode, PROMPTS, fp8,
                              tolerance=1e-3 if fp8 else 1e-4)


@torch.inference_mode()
def test_a_bf16_build_keeps_the_router_in_float32(checkpoint, tmp_path):
    """As transformers' _keep_in_fp32_modules_strict: the router weight and the moe_statics bias (flattened to
    [num_experts]) stay float32 in a bfloat16 build, the linears bfloat16; the artifact loads and generates."""
    build(recipe_from_dict({"model": str(checkpoint), "output": str(tmp_path / "bf16"), "dtype": "bfloat16",
                            "runtime": {"max_model_len": 256}}), show_progress=False)
    weights = load_file(tmp_path / "bf16" / "rank-00" / "weights.safetensors")
    source = load_file(checkpoint / "model.safetensors")
    assert weights["layers.3.moe.gate.weight"].dtype == weights["layers.3.moe.gate_bias.weight"].dtype == torch.float32
    assert torch.equal(weights["layers.3.moe.gate_bias.weight"],
                       source["model.layers.3.mlp.moe_statics.e_score_correction_bias"].reshape(-1))
    assert weights["layers.1.moe.experts.gate_up.weight"].dtype == torch.bfloat16
    assert not [name for name in weights if name.startswith(("layers.0.moe.", "layers.2.moe.", "layers.1.mlp."))]
    with LLM(tmp_path / "bf16", device="cpu", num_kv_blocks=64) as llm:
        assert llm.generate([{"prompt_token_ids": list(range(100, 120))}], GREEDY)[0].outputs[0].token_ids


@torch.inference_mode()
@pytest.mark.parametrize("parallel", [{"tensor": 2}, pytest.param({"tensor": 2, "expert": 2}, marks=pytest.mark.slow)])
def test_split_builds_match_transformers(parallel, checkpoint, tmp_path, hf_greedy, hf_logits, hf_encode):
    """Tensor parallel 2 (heads' permuted rows, the dense MLPs, shared experts and experts split by columns, the
    router and its bias whole) and expert parallel 2: transformers' logits (1e-4) and greedy tokens."""
    split = build_float32(checkpoint, tmp_path / "split", parallel=parallel)
    assert read_manifest(split).parallel.world_size == 2
    with LLM(split, **ENGINE) as llm:
        check_against_transformers(llm, checkpoint, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8),
                                   hf_greedy, hf_logits, hf_encode, 1e-4)


# ERNIE-4.5-21B-A3B-PT's shape (the keys llmc reads, written from recollection of its published config.json: the hub
# is unreachable here): 28 layers, layer 0 dense, 64 experts top-6, 2 shared, an MTP layer transformers skips
ERNIE_45_21B = {"architectures": [ARCH], "model_type": "ernie4_5_moe", "hidden_size": 2560, "intermediate_size": 12288,
                "num_hidden_layers": 28, "num_attention_heads": 20, "num_key_value_heads": 4, "head_dim": 128,
                "vocab_size": 103424, "rope_theta": 500000, "rms_norm_eps": 1e-05, "tie_word_embeddings": True,
                "use_bias": False, "moe_num_experts": 64, "moe_num_shared_experts": 2, "moe_k": 6,
                "moe_intermediate_size": 1536, "moe_layer_start_index": 1, "moe_layer_interval": 1,
                "num_nextn_predict_layers": 1, "max_position_embeddings": 131072, "torch_dtype": "bfloat16"}


def test_which_layers_are_moe_as_transformers_decides(caplog):
    """moe_layer_start_index / end_index (-1: the last) / interval against transformers' Ernie4_5_MoeModel (which
    layers hold an Ernie4_5_MoeSparseMoeBlock, on the meta device), and the 21B shape's fields and parameter count
    (cut to 3 layers); its MTP layer is not built, said in the log."""
    from transformers import AutoModelForCausalLM, Ernie4_5_MoeConfig
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeSparseMoeBlock

    spec = spec_for_architecture(ARCH)
    tiny = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
            "vocab_size": 64, "moe_num_experts": 4, "moe_k": 2, "moe_intermediate_size": 16, "num_hidden_layers": 7}
    for start, end, interval in ((1, -1, 1), (0, -1, 2), (2, 5, 3), (3, 4, 1), (0, 6, 4), (6, -1, 2)):
        config = Ernie4_5_MoeConfig(**tiny, moe_layer_start_index=start, moe_layer_end_index=end,
                                    moe_layer_interval=interval)
        with torch.device("meta"):
            layers = AutoModelForCausalLM.from_config(config).model.layers
        want = [i for i, layer in enumerate(layers) if isinstance(layer.mlp, Ernie4_5_MoeSparseMoeBlock)]
        hf = {"architectures": [ARCH], "model_type": "ernie4_5_moe", **tiny, "moe_layer_start_index": start,
              "moe_layer_end_index": end, "moe_layer_interval": interval}
        assert model_config_from_hf(hf, spec, "float32").moe_layers == want, (start, end, interval)
    with caplog.at_level("INFO", logger="llmc"):
        big = model_config_from_hf(ERNIE_45_21B, spec, "bfloat16")
    assert "the multi-token prediction layers (num_nextn_predict_layers 1, model.mtp_*) are not built" in caplog.text
    assert (big.head_dim, big.num_kv_heads, big.rope_theta, big.moe_layers[:2], len(big.moe_layers), big.num_experts,
            big.num_experts_per_tok, big.shared_expert_intermediate_size, big.router_norm_min) == (
        128, 4, 500000.0, [1, 2], 27, 64, 6, 3072, 1e-12)
    short = {**ERNIE_45_21B, "num_hidden_layers": 3}
    hf_config = Ernie4_5_MoeConfig(**{k: v for k, v in short.items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        count = AutoModelForCausalLM.from_config(hf_config).num_parameters()
    # (transformers counts the moe_statics bias, a Parameter, among them; the runtime's count leaves it out)
    assert model_config_from_hf(short, spec, "bfloat16").num_parameters + 2 * 64 == count


def test_what_ernie_moe_refuses(checkpoint, artifact, tmp_path):
    """By name: use_bias (every linear's biases), moe_layer_* given as lists (the vision-language ERNIE's), a
    non-positive moe_norm_min, importing a quantized checkpoint, ONNX targets and method int8 (as every MoE family),
    export (the permuted q/k rows)."""
    def refused(error, match, recipe=None, **changes):
        source = write_config(checkpoint, tmp_path / f"c{len(list(tmp_path.iterdir()))}", **changes) \
            if changes else checkpoint
        with pytest.raises(error, match=match):
            build(recipe_from_dict({"model": str(source), "output": str(tmp_path / "out"), "dtype": "float32",
                                    **(recipe or {})}), show_progress=False)

    refused(CheckpointError, "use_bias: true is not supported for ERNIE 4.5 MoE", use_bias=True)
    refused(CheckpointError, r"moe_layer_start_index \[1, 1\], .* ERNIE 4.5 MoE needs integers",
            moe_layer_start_index=[1, 1])
    refused(CheckpointError, "moe_norm_min 0: the router's renormalisation floor", moe_norm_min=0)
    refused(CheckpointError, "quantization.method import is not supported for ERNIE 4.5 MoE",
            recipe={"quantization": {"method": "import"}}, quantization_config={
                "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
    refused(RecipeError, "not exported to ONNX", recipe={"target": {"device": "onnx-cpu"}})
    refused(RecipeError, "quantization.method int8", recipe={"quantization": {"method": "int8"}})
    with pytest.raises(ArtifactError, match=f"{ARCH}: the build permuted q_proj's and k_proj's rows"):
        export_artifact(artifact, tmp_path / "export")
    assert read_hf_config(checkpoint)["architectures"] == [ARCH]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_on_the_gpu(checkpoint, artifact, hf_greedy, hf_logits, hf_encode, free_gpu):
    """The float32 artifact on CUDA (Triton attention over the whole-head table, the fused MoE kernel, CUDA graphs):
    transformers' logits (2e-3, as the other MoE families' GPU tests) and greedy tokens."""
    with LLM(artifact, device="cuda", gpu_memory_utilization=0.3, max_num_seqs=3, max_num_batched_tokens=16) as llm:
        assert all(layer.moe.runs_fused() for layer in llm.engine.runner.model.layers.values() if layer.is_moe)
        check_against_transformers(llm, checkpoint, PROMPTS, GREEDY, hf_greedy, hf_logits, hf_encode, 2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_a_w4_build_on_the_gpu(checkpoint, tmp_path, data_dir, hf_encode, free_gpu):
    """An RTN W4A16 build for CUDA (the experts in the fused kernel's w4a16 layout) against transformers holding its
    dequantized weights (read from the same RTN build for the CPU, whose plain layout the formats' oracle reads; RTN
    rounds both alike): logits (2e-3)."""
    from transformers import AutoModelForCausalLM

    rtn = {"method": "rtn", "bits": 4, "group_size": 32, "report": False}
    out = build_float32(checkpoint, tmp_path / "q", target={"device": "cuda"}, quantization=rtn)
    plain = build_float32(checkpoint, tmp_path / "q-cpu", target={"device": "cpu"}, quantization=rtn)
    oracle = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32, attn_implementation="eager")
    oracle.load_state_dict(moe_hf_state(plain, SCORE_BIAS, (1, -1)), strict=False)
    oracle.tie_weights()
    oracle.eval()
    token_ids = hf_encode(checkpoint, PROMPTS[1]) + list(range(100, 120))
    with LLM(out, device="cuda", gpu_memory_utilization=0.3, max_num_batched_tokens=16) as llm:
        assert all(layer.moe.runs_fused() for layer in llm.engine.runner.model.layers.values() if layer.is_moe)
        got = llm.engine.score(token_ids).cpu()
    torch.testing.assert_close(got, oracle(torch.tensor([token_ids])).logits[0], atol=2e-3, rtol=2e-3)
