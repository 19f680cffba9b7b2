"""Nemotron-H's moe (E) blocks (Nemotron 3 Nano: NVIDIA-Nemotron-3-Nano-30B-A3B) against transformers' own model
(float32) on a tiny random checkpoint whose blocks are M E * E (a Mamba-2 mixer, an MoE, attention, an MoE; Nemotron-H's
test sizes, tests/conftest): each E block 8 experts of width 32 without gate (relu2), top 2 of a sigmoid router chosen
with a random e_score_correction_bias within the best 2 of 4 groups, renormalised, times 1.5, and a relu2 shared expert
64 wide. Logits over a chunked prefill, greedy tokens and logprobs batched on fewer seats than prompts, also with the
attention and the experts on their Triton kernels (interpreted); the runtime's router against transformers'
NemotronHTopkRouter; RTN and GPTQ (-m slow) W4 (every linear and expert) against transformers holding the dequantized
weights; NemotronHConfig's default sizes with E blocks and their parameter count; the GPU's memory profile forward on
the CPU; the refusals; -m gpu: CUDA (written, not run here)."""

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (triton reads it then)

import pytest
import torch

from llmc.errors import CheckpointError
from llmc.runtime.artifact import FORMAT_VERSION, read_manifest
from llmc.runtime.llm import LLM
from tests.conftest import make_hf_checkpoint
from tests.runtime.hf_oracle import assert_same_routes, check_quantized_build, hybrid_quantization
from tests.runtime.hf_oracle import artifact_fixture
from tests.runtime.test_glm4_moe import PROMPTS, _check, _random_score_bias
from tests.runtime.test_glm4_moe import triton_dispatch  # noqa: F401 (a fixture)
from tests.runtime.test_granite4_hybrid import check_on_the_gpu
from tests.runtime.test_qwen3_5 import check_hybrid_refusals, check_memory_profile_forward
from tests.runtime.test_qwen3_5 import test_the_triton_path_matches_transformers as qwen_triton

MOE = {"hybrid_override_pattern": "ME*E", "num_hidden_layers": 4, "n_routed_experts": 8, "num_experts_per_tok": 2,
       "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 64, "n_group": 4, "topk_group": 2,
       "routed_scaling_factor": 1.5, "norm_topk_prob": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The checkpoint with each moe block's e_score_correction_bias set at random (test_glm4_moe._random_score_bias)."""
    checkpoint = make_hf_checkpoint(tmp_path_factory.mktemp("nemotron_h_moe") / "ckpt", "nemotron_h", **MOE)
    _random_score_bias(checkpoint, mtp=False, bias="mixer.gate.e_score_correction_bias")
    return checkpoint


artifact = artifact_fixture("nemotron_h_moe")


@torch.inference_mode()
def test_logits_greedy_and_logprobs_match_transformers(checkpoint, artifact, hf_logits, hf_greedy, hf_encode):
    """Logits over 40 positions prefilled in chunks of 16 (1e-4), greedy tokens of 3 prompts on 2 seats and their
    logprobs as transformers'; the manifest's E blocks (an MoE without a mixer), their router and gateless experts;
    transformers with the score bias zeroed gives other logits (the bias chooses experts here)."""
    from transformers import AutoModelForCausalLM

    manifest = read_manifest(artifact)
    m = manifest.model
    assert manifest.format_version == FORMAT_VERSION == "1.47"
    assert (m.no_mlp_layers, m.no_mixer_layers, m.moe_layers, m.mamba_layers, m.kv_layers, m.hidden_act) == (
        [0, 2], [1, 3], [1, 3], [0], [2], "relu2")
    assert (m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size, m.shared_expert_intermediate_size,
            m.router_scoring, m.router_score_bias, m.router_groups, m.router_topk_groups, m.routed_scaling_factor,
            m.norm_topk_prob) == (8, 2, 32, 64, "sigmoid", True, 4, 2, 1.5, True)
    moe = ("moe.experts.gate_up", "moe.experts.down", "moe.shared.up", "moe.shared.down")
    assert set(manifest.quant.modules) == {"lm_head", *(f"layers.{i}.{name}" for i, names in enumerate(
        [("attn.mamba_in", "attn.mamba_out"), moe, ("attn.qkv", "attn.o"), moe]) for name in names)}
    with LLM(artifact, device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        _check(llm, checkpoint, hf_logits, hf_greedy, hf_encode)
        layers = llm.engine.runner.model.layers
        assert layers["1"].attn is None and not hasattr(layers["1"], "mlp")
        assert layers["3"].moe.experts.gate_up.params()["weight"].shape == (8, 32, 64)  # up's rows alone
        assert layers["1"].moe.gate.weight.dtype == torch.float32
        token_ids = hf_encode(checkpoint, PROMPTS[1]) + list(range(100, 126))
        got = llm.engine.score(token_ids)
    unbiased = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    for layer in (1, 3):
        unbiased.model.layers[layer].mixer.gate.e_score_correction_bias.zero_()
    assert (unbiased(torch.tensor([token_ids])).logits[0] - got).abs().max() > 0.1


@torch.inference_mode()
def test_the_router_is_transformers_router(checkpoint, artifact):
    """The runtime's MoE.route (deepseek_route on the artifact's float32 router and score bias) against transformers'
    NemotronHTopkRouter of the checkpoint on 512 random hidden states, each moe block: the same experts and weights;
    the groups matter (without them other experts are chosen)."""
    from transformers import AutoModelForCausalLM

    from llmc.runtime.models.moe import deepseek_route

    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(3))
    with LLM(artifact, device="cpu", num_kv_blocks=64) as llm:
        for layer in (1, 3):
            moe = llm.engine.runner.model.layers[str(layer)].moe
            logits, want_weights, want_ids = hf.model.layers[layer].mixer.gate(x)
            weights, ids = moe.route(x)
            assert_same_routes(weights, ids, want_weights, want_ids)
            ungrouped = deepseek_route(logits, 2, "sigmoid", moe.gate_bias.weight, None, None, True, 1.5)[1]
            assert not torch.equal(ungrouped.sort(dim=-1).values, want_ids.sort(dim=-1).values)


# -m slow: the state kernels' interpreted run is Qwen3.5's, Granite 4.0's, OLMo Hybrid's and LFM2's in the default run
@pytest.mark.slow
def test_the_triton_path_matches_transformers(checkpoint, artifact, triton_dispatch, hf_logits, hf_greedy,  # noqa: F811
                                              hf_encode):
    """Qwen3.5's test on this model, the interpreter on CPU tensors: the attention block's KV write and paged attention
    and the E blocks' gateless experts on their Triton kernels (the fused MoE's grouped GEMMs with relu² between),
    the Mamba-2 mixer's conv and SSD on theirs: transformers' logits, greedy tokens, logprobs."""
    qwen_triton(checkpoint, artifact, triton_dispatch, hf_logits, hf_greedy, hf_encode)
    assert triton_dispatch["fused_moe"] > 0


@torch.inference_mode()
@pytest.mark.parametrize("method", ["rtn",
                                    *(pytest.param(m, marks=pytest.mark.slow) for m in ("gptq", "fp8"))])
def test_a_w4_build_runs_transformers_on_its_weights(method, checkpoint, tmp_path, data_dir, hf_encode):
    """RTN and GPTQ (-m slow; calibrated through the blocks in turn, each expert on the tokens routed to it) W4 of every
    linear and expert (the experts' up and down, the shared expert's) against transformers holding its dequantized
    weights (the router and its score bias dense, float32). FP8 W8A8 of the linears too (hf_oracle.hybrid_quantization),
    each FP8 input rounded in transformers as the scheme rounds it."""
    quantization, fmt, check = hybrid_quantization(method, experts=True)
    check_quantized_build(checkpoint, tmp_path, data_dir, hf_encode, quantization, PROMPTS, **check)
    modules = read_manifest(tmp_path / "q").quant.modules
    assert {modules[f"layers.{i}.{name}"]["format"] for i, name in
            [(1, "moe.shared.up"), (3, "moe.shared.down"), (2, "attn.qkv"), (0, "attn.mamba_in")]} == {fmt}
    assert {modules[f"layers.{i}.moe.experts.{name}"]["format"] for i, name in [(1, "gate_up"), (3, "down")]} == {
        "dense" if method == "fp8" else fmt}


def test_the_default_config_reads_as_transformers():
    """NemotronHConfig's defaults (8 experts of 7688, top 2, one group, a shared expert of 7688) on blocks with E blocks
    among M, * and - ones: the manifest's layers and MoE fields, and its parameter count transformers' (a model on the
    meta device)."""
    from transformers import AutoModelForCausalLM, NemotronHConfig

    from llmc.compiler.hf_checkpoint import model_config_from_hf
    from llmc.runtime.models import nemotron_h

    hf_config = NemotronHConfig(hybrid_override_pattern="MEM*E-ME")
    model = model_config_from_hf({**hf_config.to_dict(), "architectures": ["NemotronHForCausalLM"]}, nemotron_h.SPEC,
                                 "bfloat16")
    assert (model.num_layers, model.moe_layers, model.no_mixer_layers, model.no_mlp_layers, model.num_experts,
            model.num_experts_per_tok, model.moe_intermediate_size, model.shared_expert_intermediate_size,
            model.router_groups, model.router_topk_groups, model.routed_scaling_factor, model.norm_topk_prob) == (
        8, [1, 4, 7], [1, 4, 5, 7], [0, 2, 3, 6], 8, 2, 7688, 7688, 1, 1, 1.0, True)
    with torch.device("meta"):
        assert model.num_parameters == AutoModelForCausalLM.from_config(hf_config).num_parameters()


def test_what_nemotron_h_moe_refuses(checkpoint, artifact, tmp_path):
    """Refused by name as every hybrid model (prefix caching, speculative decoding, LoRA, multi-step; at build an ONNX
    target, tensor parallel, int8; an FP8 import, which dense Nemotron-H takes); of the moe blocks: a moe_latent_size,
    n_shared_experts other than 1, another scoring_func or topk_method, groups that do not split the experts."""
    refused = check_hybrid_refusals(checkpoint, artifact, tmp_path, "NemotronHForCausalLM")
    refused(CheckpointError, "moe_latent_size 32: Nemotron-H's latent MoE projections .* are not supported",
            moe_latent_size=32)
    refused(CheckpointError, "n_shared_experts 2: .* set it to 1", n_shared_experts=2)
    refused(CheckpointError, "scoring_func 'softmax', topk_method None: transformers' Nemotron-H routes by sigmoid",
            scoring_func="softmax")
    refused(CheckpointError, "n_group 3, topk_group 2: the 8 experts must split evenly", n_group=3)
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
    refused(CheckpointError, "import is not supported for NemotronHForCausalLM .* from a quantized checkpoint .*without "
            "experts", recipe={"quantization": {"method": "import"}}, quantization_config=fp8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_on_the_gpu(checkpoint, artifact, hf_logits, hf_greedy, hf_encode, free_gpu):
    """As Nemotron-H's dense test (test_granite4_hybrid.check_on_the_gpu: CUDA graphs of decode steps and eager against
    the CPU path and transformers), the moe blocks' gateless experts on the fused Triton MoE kernel (relu2 between its
    grouped GEMMs)."""
    from transformers.models.nemotron_h import modeling_nemotron_h as hf_nemotron_h

    gated_norm = getattr(hf_nemotron_h, "NemotronHRMSNormGated", None) or hf_nemotron_h.Zamba2RMSNormGated
    def runs_fused(runner):
        assert all(runner.model.layers[i].moe.runs_fused() for i in ("1", "3"))

    check_on_the_gpu(checkpoint, artifact, hf_logits, hf_greedy, hf_encode, gated_norm, check_runner=runs_fused)


def test_the_gpu_memory_profile_runs_the_hybrid(checkpoint, artifact, monkeypatch, hf_logits):
    """The GPU's memory profile forward, run on the CPU (test_qwen3_5.check_memory_profile_forward): a KV cache bound
    to the attention block alone, transformers' probabilities at the logits rows, every layer left unbound."""
    check_memory_profile_forward(checkpoint, artifact, monkeypatch, hf_logits)
