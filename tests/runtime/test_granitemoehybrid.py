"""Granite 4.0 (GraniteMoeHybridForCausalLM), its attention-only form (granite-4.0-micro's), against transformers' own
model (float32; tests/conftest.py's tiny checkpoint: 3 attention layers, no experts, the MLP its shared_mlp 96 wide,
Granite's multipliers): logits over a chunked prefill and greedy tokens of a batch on the CPU path, the Triton path
(interpreted on CPU tensors) and the onnx-cpu graph, with rotary (position_embedding_type rope) and without (nope, the
hybrids' setting); tensor parallel 2 (-m slow); what the mapping rests on (the folds, the
shared_mlp read as the dense MLP, rotary mattering); RTN W4 (GPTQ, AWQ, FP8 with -m slow) on its own weights; how the
config is read (the published "attention" spelling, GraniteMoeHybridConfig's defaults); every refusal."""

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (triton reads it then)

import pytest
import torch
from safetensors.torch import load_file

from llmc.compiler.export import export_artifact
from llmc.compiler.hf_checkpoint import model_config_from_hf, read_hf_config
from llmc.errors import ArtifactError, CheckpointError, ConfigError
from llmc.runtime.artifact import FORMAT_VERSION, read_manifest
from llmc.runtime.llm import LLM
from llmc.runtime.models import granitemoehybrid
from llmc.runtime.sampling_params import SamplingParams
from tests.conftest import make_hf_checkpoint
from tests.runtime.hf_oracle import (build_float32, check_against_transformers, check_quantized_build,
                                     check_tensor_parallel, float32_artifacts, write_config)
from tests.runtime.test_exaone4_seed_ernie import triton_dispatch  # noqa: F401 (a fixture)

PROMPTS = ["ROMEO:", "What light through yonder window breaks? It is the east", "In the beginning"]
GREEDY = SamplingParams(temperature=0, max_tokens=16)
ENGINE = {"device": "cpu", "max_num_seqs": 2, "max_num_batched_tokens": 16, "num_kv_blocks": 64}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """variant → its tiny checkpoint: rotary (granite-4.0-micro's form) and NoPE (the same weights, no rotary)."""
    root = tmp_path_factory.mktemp("granitemoehybrid")
    return {"rope": make_hf_checkpoint(root / "rope", "granitemoehybrid"),
            "nope": make_hf_checkpoint(root / "nope", "granitemoehybrid", position_embedding_type="nope")}


@pytest.fixture(scope="module")
def artifacts(checkpoints, tmp_path_factory):
    return float32_artifacts(checkpoints, tmp_path_factory.mktemp("granitemoehybrid_artifacts"))


@torch.inference_mode()
@pytest.mark.parametrize("variant,nope_layers", [("rope", []), ("nope", [0, 1, 2])])
def test_logits_and_greedy_match_transformers(variant, nope_layers, checkpoints, artifacts, hf_greedy, hf_logits,
                                              hf_encode):
    """Logits at 50 positions prefilled in chunks of 16 and 16 greedy tokens of three prompts batched two at a time:
    transformers' float32 model's, to 1e-4."""
    manifest = read_manifest(artifacts(variant))
    m = manifest.model
    assert manifest.format_version == FORMAT_VERSION == "1.47"
    assert (m.family, m.nope_layers, m.intermediate_size, m.embed_scale, m.softmax_scale, m.num_experts) == (
        "granitemoehybrid", nope_layers, 96, 12.0, 0.05, None)
    with LLM(artifacts(variant), **ENGINE) as llm:
        check_against_transformers(llm, checkpoints[variant], PROMPTS, GREEDY, hf_greedy, hf_logits, hf_encode, 1e-4)
    assert all(len(set(tokens)) > 4 for tokens in hf_greedy(checkpoints[variant], PROMPTS, 16))


@torch.inference_mode()
@pytest.mark.parametrize("variant", ["rope", "nope"])
def test_the_triton_path_matches_transformers(variant, checkpoints, artifacts, triton_dispatch, hf_greedy, hf_logits,
                                              hf_encode):
    """The Triton rotary + KV-write kernel (the NoPE variant's layers by the identity table) and attention kernel
    (attention_multiplier its scale), in Triton's interpreter on CPU tensors: transformers' logits and greedy tokens."""
    with LLM(artifacts(variant), **ENGINE) as llm:
        check_against_transformers(llm, checkpoints[variant], PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6),
                                   hf_greedy, hf_logits, hf_encode, 1e-4)
    assert triton_dispatch["rotate_and_write_kv"] > 0


@pytest.mark.parametrize("variant", ["rope", "nope"])
def test_onnx_cpu_matches_transformers(variant, checkpoints, tmp_path, hf_greedy, hf_logits, hf_encode):
    """The onnx-cpu graph (Granite's: the multipliers as scales and folds; the NoPE variant without rotary in its
    GroupQueryAttention nodes): transformers' logits and greedy tokens."""
    import onnx

    artifact = build_float32(checkpoints[variant], tmp_path / "onnx", target={"device": "onnx-cpu"})
    graph = onnx.load(str(artifact / "onnx" / "model.onnx"), load_external_data=False).graph
    attention = [node for node in graph.node if node.op_type == "GroupQueryAttention"]
    assert [next(a.i for a in node.attribute if a.name == "do_rotary") for node in attention] == [
        int(variant == "rope")] * 3
    with LLM(artifact, device="cpu", max_num_seqs=2, max_num_batched_tokens=16) as llm:
        check_against_transformers(llm, checkpoints[variant], PROMPTS, GREEDY, hf_greedy, hf_logits, hf_encode, 1e-4)


@pytest.mark.slow  # 4 s on 2 cores, as Granite's
def test_tensor_parallel_matches_one_rank(checkpoints, artifacts, tmp_path, hf_encode):
    """Two ranks: each holds its rows of shared_mlp.input_linear's gate and of its up, its heads, the folded o and
    down: the same greedy tokens and logits as one rank."""
    check_tensor_parallel(checkpoints["rope"], artifacts("rope"), tmp_path, hf_encode, PROMPTS, GREEDY)


@torch.inference_mode()
def test_what_the_mapping_rests_on(checkpoints, artifacts, hf_logits, hf_encode):
    """The artifact holds shared_mlp.input_linear as mlp.gate_up (its gate rows, then up: the runtime's order) and
    output_linear as mlp.down, the latter and o_proj times residual_multiplier (0.3), the final norm divided by
    logits_scaling (5); rotary matters on this model (the two variants' weights are the same, their logits are not)."""
    hf = load_file(checkpoints["rope"] / "model.safetensors")
    ours = load_file(artifacts("rope") / "rank-00" / "weights.safetensors")
    for i in range(3):
        layer = f"model.layers.{i}."
        torch.testing.assert_close(ours[f"layers.{i}.mlp.gate_up.weight"], hf[f"{layer}shared_mlp.input_linear.weight"],
                                   rtol=0, atol=0)
        torch.testing.assert_close(ours[f"layers.{i}.mlp.down.weight"],
                                   0.3 * hf[f"{layer}shared_mlp.output_linear.weight"])
        torch.testing.assert_close(ours[f"layers.{i}.attn.o.weight"], 0.3 * hf[f"{layer}self_attn.o_proj.weight"])
    torch.testing.assert_close(ours["norm.weight"], hf["model.norm.weight"] / 5.0)
    token_ids = hf_encode(checkpoints["rope"], PROMPTS[1]) + list(range(100, 140))
    rope, nope = hf_logits(checkpoints["rope"], token_ids), hf_logits(checkpoints["nope"], token_ids)
    # measured 0.25 (attention_multiplier 0.05 keeps the scores small), 1600 times the logits' tolerance
    assert (rope - nope).abs().mean() > 0.1 * rope.abs().mean()


@torch.inference_mode()
@pytest.mark.parametrize("quantization", [
    {"method": "rtn", "bits": 4, "group_size": 32},
    # calibrated: Granite's code (tests/runtime/test_granite.py runs them); with -m slow here
    pytest.param({"method": "gptq", "bits": 4, "group_size": 32}, marks=pytest.mark.slow),
    pytest.param({"method": "awq", "bits": 4, "group_size": 32}, marks=pytest.mark.slow),
    pytest.param({"method": "fp8"}, marks=pytest.mark.slow),
], ids=["rtn-w4", "gptq-w4", "awq-w4", "fp8"])
def test_quantized_builds_run_transformers_on_their_weights(quantization, checkpoints, tmp_path, data_dir, hf_encode):
    """Each build is transformers' GraniteMoeHybridForCausalLM on the artifact's own weights (hf_oracle.hf_state_of:
    dequantized, the folds undone, gate_up back into shared_mlp.input_linear): logits and greedy tokens. FP8 to 2e-3:
    one of the 34 positions has an activation at an E4M3 rounding boundary, which float32 reassociation moves to the
    other side (measured 1e-3 there, 2e-6 at the other 33)."""
    tolerance = 2e-3 if quantization["method"] == "fp8" else 1e-4
    check_quantized_build(checkpoints["rope"], tmp_path, data_dir, hf_encode, quantization, PROMPTS, tolerance)


def test_config_read_as_transformers_reads_it(checkpoints):
    """The published spelling ("attention" per layer, as granite-4.0-micro's config.json has it) and transformers'
    ("full_attention") read alike; the MLP's width is shared_intermediate_size, never intermediate_size;
    position_embedding_type absent is GraniteMoeHybridConfig's null: no rotary in any layer."""
    config = read_hf_config(checkpoints["rope"])
    assert config["layer_types"] == ["full_attention"] * 3
    spec = granitemoehybrid.SPEC
    published = model_config_from_hf({**config, "layer_types": ["attention"] * 3}, spec, "float32")
    assert published == model_config_from_hf(config, spec, "float32")
    assert (published.intermediate_size, published.nope_layers) == (96, [])
    absent = {k: v for k, v in config.items() if k != "position_embedding_type"}
    assert model_config_from_hf(absent, spec, "float32").nope_layers == [0, 1, 2]


@pytest.mark.parametrize("changes,message", [
    ({"layer_types": ["attention", "sliding_attention", "mamba"]}, "layer_types ['attention', 'sliding_attention', "
                                                                   "'mamba']: Granite 4.0's layers are attention or "
                                                                   "mamba"),
    ({"layer_types": ["attention"] * 2}, "layer_types has 2 entries for 3 layers"),
    ({"position_embedding_type": "alibi"}, "position_embedding_type 'alibi' is not supported for Granite 4.0"),
    ({"residual_multiplier": 0.0}, "residual_multiplier 0.0: Granite's multipliers must be positive numbers"),
    ({"attention_bias": True}, "attention_bias: true is not supported for Granite"),
], ids=["layer-kind", "layer-count", "alibi", "zero-residual", "attention-bias"])
def test_what_llmc_does_not_run_is_refused_by_name(checkpoints, tmp_path, changes, message):
    checkpoint = write_config(checkpoints["rope"], tmp_path / "ckpt", **changes)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace("[", r"\[")):
        build_float32(checkpoint, tmp_path / "out")


def test_import_export_and_lora_are_refused_by_name(checkpoints, artifacts, tmp_path):
    """As Granite's: the residual fold cannot go into a pre-quantized checkpoint's packed weights, an export would
    write folded weights that transformers scales again, and a run-time adapter's o_proj / down deltas would miss the
    folded residual_multiplier."""
    with pytest.raises(CheckpointError, match="quantization.method import is not supported for Granite"):
        build_float32(checkpoints["rope"], tmp_path / "imported", quantization={"method": "import"})
    with pytest.raises(ArtifactError, match="cannot export architecture GraniteMoeHybridForCausalLM: the build folded"):
        export_artifact(artifacts("rope"), tmp_path / "export")
    with pytest.raises(ConfigError, match=r"run-time LoRA does not run on Granite \(its residual_multiplier"):
        LLM(artifacts("rope"), device="cpu", enable_lora=True)


# ---- on a GPU ------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", ["rope", "nope"])
def test_float32_on_the_gpu_matches_transformers(variant, checkpoints, artifacts, hf_greedy, hf_logits, hf_encode,
                                                 free_gpu):
    """Granite's CUDA path (Triton attention with its scale, CUDA graphs) with and without rotary."""
    llm = LLM(artifacts(variant), device="cuda", gpu_memory_utilization=0.3, max_num_seqs=2, max_num_batched_tokens=16)
    check_against_transformers(llm, checkpoints[variant], PROMPTS, GREEDY, hf_greedy, hf_logits, hf_encode, 2e-3)
    llm.close()
