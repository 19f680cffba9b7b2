"""Arcee AFM (ArceeForCausalLM) and Swiss AI Apertus (ApertusForCausalLM) against transformers' own models (float32,
tiny random checkpoints of tests/conftest.py: Llama's GQA 4/2, MLPs without gate 96 wide; Arcee relu2 with a YaRN
rope, Apertus xIELU with random per-layer alpha_p / alpha_n, per-head q/k norms and Llama 3's rope scaling). Logits at
every position of a prefill in chunks of 16, greedy tokens and logprobs of prompts batched on fewer seats, on the CPU
path, with the attention on its Triton kernels (interpreted) and with decode steps through a decode graph's static
buffers; RTN and GPTQ W4 builds against transformers holding their dequantized weights; the runtime's xIELU against
transformers' XIELUActivation in float64; what the mappings rest on; the config classes' defaults and their parameter
counts; the refusals; -m slow: GPTQ, two tensor ranks or two pipeline stages as one; -m gpu: CUDA (written, not
run here)."""

import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (triton reads it then)

import pytest
import torch
from safetensors.torch import load_file

from llmc.compiler.export import export_artifact
from llmc.errors import ArtifactError, CheckpointError, ConfigError, RecipeError
from llmc.runtime.artifact import FORMAT_VERSION, read_manifest
from llmc.runtime.llm import LLM
from tests.conftest import make_hf_checkpoint
from tests.runtime.hf_oracle import check_quantized_build, check_tensor_parallel, float32_artifacts, write_config
from tests.runtime.test_glm4_moe import PROMPTS, _check
from tests.runtime.test_glm4_moe import triton_dispatch  # noqa: F401 (a fixture)
from tests.runtime.test_qwen3_5 import StaticDecodeSteps

FAMILIES = ("arcee", "apertus")
ENGINE = {"device": "cpu", "max_num_seqs": 2, "max_num_batched_tokens": 16, "num_kv_blocks": 64}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("arcee_apertus")
    return {family: make_hf_checkpoint(root / family, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def artifacts(checkpoints, tmp_path_factory):
    return float32_artifacts(checkpoints, tmp_path_factory.mktemp("arcee_apertus_artifacts"))


# what each manifest says: (hidden_act, qk_norm, rope type, the layer's linears)
MANIFEST = {"arcee": ("relu2", False, "yarn"), "apertus": ("xielu", True, "llama3")}


@torch.inference_mode()
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_greedy_and_logprobs_match_transformers(family, checkpoints, artifacts, hf_logits, hf_greedy,
                                                       hf_encode):
    """Logits over 40 positions prefilled in chunks of 16 (1e-4), greedy tokens of 3 prompts on 2 seats and their
    logprobs as transformers'; the manifest's activation, q/k norms and rope; up and down, no gate_up, in every layer;
    Apertus's xIELU scalars stored float32 as its checkpoint holds them."""
    manifest = read_manifest(artifacts(family))
    m = manifest.model
    assert manifest.format_version == FORMAT_VERSION == "1.47"
    assert (m.family, m.hidden_act, m.qk_norm, m.rope_scaling["rope_type"], m.gated_mlp) == (
        family, *MANIFEST[family], False)
    assert set(manifest.quant.modules) == {"lm_head", *(f"layers.{i}.{name}" for i in range(2) for name in (
        "attn.qkv", "attn.o", "mlp.up", "mlp.down"))}
    tensors = load_file(artifacts(family) / "rank-00" / "weights.safetensors")
    if family == "apertus":
        hf = load_file(checkpoints[family] / "model.safetensors")
        for i in range(2):
            assert tensors[f"layers.{i}.mlp.xielu.weight"].dtype == torch.float32
            assert tensors[f"layers.{i}.mlp.xielu.weight"].tolist() == [
                float(hf[f"model.layers.{i}.mlp.act_fn.{name}"]) for name in ("alpha_p", "alpha_n", "beta", "eps")]
    else:
        assert not any("xielu" in name for name in tensors)
    with LLM(artifacts(family), **ENGINE) as llm:
        _check(llm, checkpoints[family], hf_logits, hf_greedy, hf_encode)
        mlp = llm.engine.runner.model.layers["1"].mlp
        assert not hasattr(mlp, "gate_up") and mlp.act == MANIFEST[family][0]


def test_xielu_is_transformers_activation():
    """The runtime's xIELU (decoder.xielu) on values either side of 0 and of eps, against transformers'
    XIELUActivation (its Python form) built in float64 with other alpha_p, alpha_n, beta and eps than the defaults."""
    from transformers.activations import XIELUActivation

    from llmc.runtime.models.decoder import xielu

    act = XIELUActivation(alpha_p_init=1.3, alpha_n_init=0.9, beta=0.25, eps=-1e-3, dtype=torch.float64)
    x = torch.cat([torch.randn(200, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3,
                   torch.tensor([0.0, -1e-3, -2e-3, -5e-4, 1e-6], dtype=torch.float64)])
    params = torch.cat([act.alpha_p, act.alpha_n, act.beta[None], act.eps[None]]).detach()
    torch.testing.assert_close(xielu(x, params), act._xielu_python(x).detach(), atol=1e-12, rtol=1e-12)


@torch.inference_mode()
def test_what_the_mappings_rest_on(checkpoints, tmp_path, hf_logits, hf_encode):
    """transformers' Arcee without its YaRN (the default rope), and Apertus with another xIELU beta in layer 0, are far
    from the models matched above: those comparisons fail if the rope scaling or the stored scalars were dropped."""
    from safetensors.torch import save_file

    token_ids = hf_encode(checkpoints["arcee"], PROMPTS[1]) + list(range(100, 140))
    expected = hf_logits(checkpoints["arcee"], token_ids)
    changed = hf_logits(write_config(checkpoints["arcee"], tmp_path / "arcee", rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0}), token_ids)
    assert (changed - expected).abs().mean() > 0.05 * expected.abs().mean()
    expected = hf_logits(checkpoints["apertus"], token_ids)
    source = write_config(checkpoints["apertus"], tmp_path / "apertus")
    tensors = load_file(source / "model.safetensors")
    tensors["model.layers.0.mlp.act_fn.beta"] = torch.tensor(0.1)
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    changed = hf_logits(source, token_ids)
    assert (changed - expected).abs().mean() > 0.05 * expected.abs().mean()


@torch.inference_mode()
@pytest.mark.parametrize("family", FAMILIES)
def test_the_triton_path_matches_transformers(family, checkpoints, artifacts, triton_dispatch,  # noqa: F811
                                              hf_logits, hf_greedy, hf_encode):
    """The rotary + KV write and paged attention on their Triton kernels (the interpreter on CPU tensors; Apertus's q/k
    norms before them), the MLPs in torch: transformers' logits, greedy tokens and logprobs."""
    with LLM(artifacts(family), **ENGINE) as llm:
        _check(llm, checkpoints[family], hf_logits, hf_greedy, hf_encode, PROMPTS[:2])
    assert triton_dispatch["rotate_and_write_kv"]


@torch.inference_mode()
@pytest.mark.parametrize("family", FAMILIES)
def test_decodes_through_the_graphs_static_buffers(family, checkpoints, artifacts, hf_logits, hf_greedy, hf_encode):
    """What a decode graph replays (runtime/cuda_graphs.py), on the CPU: decode steps padded to 4 rows (the padding on
    a scratch block): transformers' greedy tokens and logprobs."""
    with LLM(artifacts(family), device="cpu", max_num_seqs=3, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        runner = llm.engine.runner
        runner.graphs = StaticDecodeSteps(runner, scratch_block=63)  # (the 3 prompts take fewer than 63 blocks)
        _check(llm, checkpoints[family], hf_logits, hf_greedy, hf_encode)
        assert runner.graphs.num_replays > 0


@torch.inference_mode()
@pytest.mark.parametrize("method", ["rtn", pytest.param("gptq", marks=pytest.mark.slow)])  # GPTQ: calibrated
@pytest.mark.parametrize("family", FAMILIES)
def test_a_w4_build_runs_transformers_on_its_weights(family, method, checkpoints, tmp_path, data_dir, hf_encode):
    """RTN and GPTQ (calibrated through the layers) W4 g32 of q/k/v, o and the MLPs' up and down, against
    transformers holding the artifact's dequantized weights (and Apertus's xIELU scalars as stored)."""
    check_quantized_build(checkpoints[family], tmp_path, data_dir, hf_encode,
                          {"method": method, "bits": 4, "group_size": 32}, PROMPTS)
    modules = read_manifest(tmp_path / "q").quant.modules
    assert {modules[f"layers.{i}.{name}"]["format"] for i in range(2) for name in ("mlp.up", "mlp.down")} == {"w4a16"}


@pytest.mark.slow  # (about 20 s each)
@pytest.mark.parametrize("parallel", [{"tensor": 2}, {"pipeline": 2}], ids=["tensor", "pipeline"])
@pytest.mark.parametrize("family", FAMILIES)
def test_split_over_two_ranks_as_one(family, parallel, checkpoints, artifacts, tmp_path, hf_encode):
    """Two tensor ranks (each up's half of the rows, down's half of the columns, Apertus's xIELU scalars whole on
    both) or two pipeline stages: the one-rank artifact's greedy tokens and logits (5e-5: down's partial sums add in
    another order, on relu2's squared activations 1.3e-5 off)."""
    from llmc.runtime.sampling_params import SamplingParams

    check_tensor_parallel(checkpoints[family], artifacts(family), tmp_path, hf_encode, PROMPTS,
                          SamplingParams(temperature=0, max_tokens=8), parallel=parallel, atol=5e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_default_config_reads_as_transformers(family):
    """ArceeConfig's (AFM-4.5B: 2560 wide, 32 layers, relu2 MLP 18432 wide) and ApertusConfig's (Apertus-8B: 4096
    wide, xIELU MLP 14336 wide, Llama 3's rope x8 over 8192 positions, theta 1.2e7) defaults: the manifest's sizes and
    rope, and its parameter count transformers' (a model on the meta device; Apertus's xIELU alpha_p and alpha_n
    counted, its beta and eps buffers not). A config.json of Apertus without rope keys reads ApertusConfig's rope."""
    from transformers import ApertusConfig, ArceeConfig, AutoModelForCausalLM

    from llmc.compiler.hf_checkpoint import model_config_from_hf
    from llmc.runtime.models import spec_for_architecture

    hf_config = ArceeConfig() if family == "arcee" else ApertusConfig()
    arch = "ArceeForCausalLM" if family == "arcee" else "ApertusForCausalLM"
    raw = {**hf_config.to_dict(), "architectures": [arch]}
    model = model_config_from_hf(raw, spec_for_architecture(arch), "bfloat16")
    sizes = {"arcee": (2560, 18432, 32, 32, 32, 80, "relu2", None, 10000.0),
             "apertus": (4096, 14336, 32, 32, 32, 128, "xielu", "llama3", 12000000.0)}[family]
    assert (model.hidden_size, model.intermediate_size, model.num_layers, model.num_heads, model.num_kv_heads,
            model.head_dim, model.hidden_act, (model.rope_scaling or {}).get("rope_type"), model.rope_theta) == sizes
    with torch.device("meta"):
        assert model.num_parameters == AutoModelForCausalLM.from_config(hf_config).num_parameters()
    if family == "apertus":
        bare = {k: v for k, v in raw.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
        read = model_config_from_hf(bare, spec_for_architecture(arch), "bfloat16")
        assert (read.rope_theta, read.rope_scaling) == (model.rope_theta, model.rope_scaling)
        assert model.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@pytest.mark.parametrize("family", FAMILIES)
def test_what_arcee_and_apertus_refuse(family, checkpoints, artifacts, tmp_path, data_dir):
    """Refused by name: another hidden_act, attention_bias, mlp_bias (config); an ONNX target, a quantization method
    other than none / rtn / gptq (build); run-time LoRA (start); `llmc export`."""
    from llmc.compiler.build import build
    from llmc.compiler.recipe import recipe_from_dict

    name = {"arcee": "Arcee", "apertus": "Apertus"}[family]

    def refused(error, match, recipe=None, **changes):
        source = write_config(checkpoints[family], tmp_path / f"c{len(list(tmp_path.iterdir()))}", **changes) \
            if changes else checkpoints[family]
        with pytest.raises(error, match=match):
            build(recipe_from_dict({"model": str(source), "output": str(tmp_path / "out"), "dtype": "float32",
                                    **(recipe or {})}), show_progress=False)

    refused(CheckpointError, f"hidden_act 'silu' is not supported for {name}: .* without gate with "
                             f"{MANIFEST[family][0]} only", hidden_act="silu")
    for key in ("attention_bias", "mlp_bias"):
        refused(CheckpointError, f"{key}: true is not supported for {name}", **{key: True})
    what = f"\\(an MLP without gate, hidden_act {MANIFEST[family][0]}\\)"
    refused(RecipeError, f"target.device onnx-cpu: .*{what} is not exported to ONNX",
            recipe={"target": {"device": "onnx-cpu"}})
    calibration = {"data": str(data_dir / "calibration.txt"), "num_samples": 4, "seq_len": 32}
    for method in ("awq", "fp8", "int8"):
        refused(RecipeError, f"quantization.method {method}: .*{what} builds with none, rtn, gptq",
                recipe={"quantization": {"method": method, "calibration": calibration}})
    with pytest.raises(ConfigError, match="enable_lora: run-time LoRA does not run on .*MLP without gate"):
        LLM(artifacts(family), device="cpu", num_kv_blocks=64, enable_lora=True)
    with pytest.raises(ArtifactError, match="its MLP without gate .* is not exported; serve it with `llmc run`"):
        export_artifact(artifacts(family), tmp_path / "export")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
@pytest.mark.parametrize("family", FAMILIES)
def test_on_the_gpu(family, checkpoints, artifacts, hf_logits, hf_greedy, hf_encode, free_gpu):
    """The float32 artifact on CUDA, with CUDA graphs (piecewise prefill, decode) and with enforce_eager: transformers'
    logits (2e-3), greedy tokens and logprobs (the Triton attention, the MLP's activation in torch ops)."""
    for eager in (False, True):
        with LLM(artifacts(family), device="cuda", gpu_memory_utilization=0.3, max_num_seqs=2,
                 max_num_batched_tokens=16, enforce_eager=eager) as llm:
            _check(llm, checkpoints[family], hf_logits, hf_greedy, hf_encode, tolerance=2e-3)
            assert eager or llm.engine.runner.graphs.num_replays > 0
