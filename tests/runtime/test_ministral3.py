"""Ministral 3 (Ministral3ForCausalLM; Mistral3ForConditionalGeneration with a ministral3 text model) against
transformers' own float32 models: Mistral's decoder with YaRN and the query temperature, q times 1 + beta * log(1 +
floor(position / original_max_position_embeddings)) in every layer (tests/conftest.py's checkpoint: beta 0.3 over 8
positions, so the 50 positions scored and the greedy tokens pass its threshold six times). Logits over a chunked
prefill and greedy decoding on the torch CPU path and on the Triton kernels (the interpreter), what the match rests
on, RTN / GPTQ W4 and FP8 builds, the calibration runner, two tensor ranks, an image case, `llmc export` and back,
a sequence classifier, the manifest's fields, how the config is read and what is refused; the CUDA cases are marked
gpu."""

import dataclasses
import math
import os

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (triton reads it then)

import pytest
import torch
from click.testing import CliRunner

from llmc.cli import cli
from llmc.compiler.build import build
from llmc.compiler.export import export_artifact
from llmc.compiler.hf_checkpoint import model_config_from_hf, read_hf_config
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ArtifactError, CheckpointError, RecipeError
from llmc.runtime.artifact import FORMAT_VERSION, read_manifest
from llmc.runtime.llm import LLM
from llmc.runtime.models import ministral3, spec_for_architecture
from llmc.runtime.models.decoder import query_temperature
from llmc.runtime.sampling_params import SamplingParams
from tests.conftest import MINISTRAL3_ROPE, make_hf_checkpoint
from tests.runtime.hf_oracle import build_float32, check_against_transformers, check_quantized_build, write_config
from tests.runtime.test_exaone4_seed_ernie import triton_dispatch  # noqa: F401 - a fixture

PROMPTS = ["ROMEO:", "What light through yonder window breaks? It is the east", "In the beginning"]
GREEDY = SamplingParams(temperature=0, max_tokens=16)
ENGINE = {"device": "cpu", "max_num_seqs": 2, "max_num_batched_tokens": 16, "num_kv_blocks": 64}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("ministral3") / "hf", "ministral3")


@pytest.fixture(scope="module")
def artifact(checkpoint, tmp_path_factory):
    return build_float32(checkpoint, tmp_path_factory.mktemp("ministral3_artifact") / "a")


def _score_ids(checkpoint, hf_encode):
    return hf_encode(checkpoint, PROMPTS[1]) + list(range(100, 140))  # 50 positions


@torch.inference_mode()
def test_logits_and_greedy_match_transformers(checkpoint, artifact, hf_greedy, hf_logits, hf_encode):
    """The manifest's temperature (beta, floor original_max_position_embeddings, offset 0, every layer) and YaRN;
    logits at 50 positions prefilled in chunks of 16 (1e-4) and 16 greedy tokens of three prompts batched two at a
    time: transformers' float32 model's."""
    manifest = read_manifest(artifact)
    m = manifest.model
    assert manifest.format_version == FORMAT_VERSION == "1.47"
    assert (m.family, m.query_temperature_beta, m.query_temperature_floor, m.query_temperature_offset,
            m.query_temperature_layers, m.rope_scaling["rope_type"], m.attention_bias) == (
        "ministral3", 0.3, 8.0, 0.0, None, "yarn", False)
    assert "llama_4_scaling_beta" not in m.rope_scaling
    with LLM(artifact, **ENGINE) as llm:
        check_against_transformers(llm, checkpoint, PROMPTS, GREEDY, hf_greedy, hf_logits, hf_encode, 1e-4)
    assert all(len(set(tokens)) > 4 for tokens in hf_greedy(checkpoint, PROMPTS, 16))


@torch.inference_mode()
def test_the_temperature_is_what_the_match_rests_on(checkpoint, tmp_path, hf_logits, hf_encode):
    """transformers with llama_4_scaling_beta 0 (no temperature) is far from the model past position 8 and equal to
    it below (the factor is exactly 1 there); the runtime's factor is transformers' get_llama_4_attn_scale at every
    position, and Llama 4's form (offset 1, floor_scale) is its float64 value."""
    from transformers.models.ministral3.modeling_ministral3 import get_llama_4_attn_scale

    token_ids = _score_ids(checkpoint, hf_encode)
    expected = hf_logits(checkpoint, token_ids)
    flat = write_config(checkpoint, tmp_path / "flat", rope_parameters={**MINISTRAL3_ROPE, "llama_4_scaling_beta": 0.0})
    changed = hf_logits(flat, token_ids)
    assert torch.equal(changed[:8], expected[:8])
    assert (changed[8:] - expected[8:]).abs().mean() > 0.05 * expected.abs().mean()
    positions = torch.arange(300)
    factor = query_temperature(positions, 0.3, 8.0, 0.0)
    assert torch.equal(factor[:8], torch.ones(8)) and factor[8] > 1
    torch.testing.assert_close(factor, get_llama_4_attn_scale(positions[None], 0.3, 8)[0, 0, :, 0], atol=0, rtol=0)
    llama4 = query_temperature(positions, 0.1, 16.0, 1.0)
    want = torch.tensor([1 + 0.1 * math.log1p(math.floor((p + 1) / 16)) for p in range(300)], dtype=torch.float64)
    torch.testing.assert_close(llama4.double(), want, atol=1e-6, rtol=0)
    assert torch.equal(llama4[:15], torch.ones(15)) and llama4[15] > 1


@torch.inference_mode()
def test_the_triton_path_matches_transformers(checkpoint, artifact, triton_dispatch, hf_greedy, hf_logits,  # noqa: F811
                                              hf_encode):
    """The Triton rotary + KV-write, prefill and decode attention kernels (the interpreter) on q scaled by position:
    transformers' logits at 50 positions in chunks of 16 and 6 greedy tokens of two prompts."""
    with LLM(artifact, **ENGINE) as llm:
        check_against_transformers(llm, checkpoint, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6),
                                   hf_greedy, hf_logits, hf_encode, 1e-4)
    assert triton_dispatch["rotate_and_write_kv"] > 0


@pytest.mark.parametrize("quantization", [{"method": "rtn", "bits": 4, "group_size": 32},
                                          {"method": "gptq", "bits": 4, "group_size": 32}, {"method": "fp8"}],
                         ids=["rtn", "gptq", "fp8"])
def test_a_quantized_build_is_transformers_on_its_weights(quantization, checkpoint, tmp_path, data_dir, hf_encode):
    """RTN and GPTQ W4A16 (groups of 32; GPTQ calibrated on 32-token windows, past the threshold) and FP8:
    transformers' model holding the artifact's dequantized weights (FP8: its inputs rounded per token) gives its
    logits (1e-4) and 16 greedy tokens (hf_oracle.check_quantized_build)."""
    check_quantized_build(checkpoint, tmp_path, data_dir, hf_encode, quantization, PROMPTS)
    modules = read_manifest(tmp_path / "q").quant.modules
    formats = {spec["format"] for name, spec in modules.items() if name.startswith("layers.")}
    assert formats == ({"w8a8-fp8"} if quantization["method"] == "fp8" else {"w4a16"})


@torch.inference_mode()
def test_the_calibration_runner_runs_each_layer_as_transformers(checkpoint, hf_model):
    """The layers GPTQ and AWQ calibrate through (compiler/calibration.LayerRunner) give transformers' next hidden
    states over 32 positions (the temperature's factors 1 to 1 + 0.3 log 4), layers 0 and 1 (the last one's hidden
    state is transformers' after the final norm)."""
    from llmc.compiler.calibration import LayerRunner
    from llmc.compiler.convert import read_layer
    from llmc.compiler.hf_checkpoint import TensorReader

    config = _read(read_hf_config(checkpoint))
    states = hf_model(checkpoint)(input_ids=torch.arange(100, 132).view(1, 32), output_hidden_states=True).hidden_states
    runner = LayerRunner(config, seq_len=32, device=torch.device("cpu"))
    with TensorReader(checkpoint) as reader:
        for index in range(config.num_layers - 1):
            layer = runner.build_layer(read_layer(reader, ministral3.SPEC, config, index))
            assert layer.attn.temperature == (0.3, 8.0, 0.0)
            torch.testing.assert_close(runner.forward(layer, states[index]), states[index + 1], atol=1e-4, rtol=1e-4)


def test_two_tensor_ranks_give_the_one_rank_model(checkpoint, artifact, tmp_path, hf_encode):
    """Two tensor ranks (each its two heads, each scaling them): the one-rank artifact's greedy tokens and logits
    (5e-5: the all-reduces add the ranks' partial sums in another order)."""
    split = build_float32(checkpoint, tmp_path / "tp2", parallel={"tensor": 2})
    token_ids = _score_ids(checkpoint, hf_encode)
    results = []
    for built in (split, artifact):
        with LLM(built, **ENGINE) as llm:
            results.append(([o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)],
                            llm.engine.score(token_ids)))
    assert results[0][0] == results[1][0]
    torch.testing.assert_close(results[0][1], results[1][1], atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_mistral3_with_a_ministral3_text_model_matches_transformers(device, tmp_path):
    """Mistral3ForConditionalGeneration whose text_config is a Ministral 3 (the published Ministral 3 checkpoints'
    form): built as Ministral3ForCausalLM with its temperature; one image, another size, both in one prompt and a
    prompt without images (prompts past position 16): transformers' prompt ids, greedy tokens and their logprobs
    (on CUDA: -m gpu, 2e-3)."""
    from tests.runtime.test_llava import image
    from tests.runtime.test_mistral3_vision import (GREEDY as IMAGE_GREEDY, PROMPT, SMALL, TWO, _hf, hf_generate,
                                                    make_pixtral_checkpoint)
    from tests.runtime.vision_oracle import check_image_requests

    checkpoint = make_pixtral_checkpoint(tmp_path / "hf", text_config_class="Ministral3Config")
    built = build_float32(checkpoint, tmp_path / "a", target={"device": "cpu"})
    model = read_manifest(built).model
    assert (model.architecture, model.query_temperature_beta, model.query_temperature_floor) == (
        "Ministral3ForCausalLM", 0.3, 8.0)
    hf = _hf(checkpoint, llava=False)
    first, second = image(1), image(2, size=SMALL)
    expected = [hf_generate(hf, PROMPT, [first]), hf_generate(hf, PROMPT, [second]),
                hf_generate(hf, TWO, [first, second])]
    plain_ids = hf[1]("[INST]Hello there.[/INST]")["input_ids"]
    expected.append(hf_generate(hf, plain_ids, None))
    assert max(len(ids) for ids, _, _ in expected) > 16
    llm = LLM(built, device=device, max_num_batched_tokens=64, max_num_seqs=4, num_kv_blocks=64, block_size=8,
              gpu_memory_utilization=0.3)
    check_image_requests(llm, IMAGE_GREEDY, expected, PROMPT, TWO, plain_ids, first, second,
                         2e-4 if device == "cpu" else 2e-3)


def test_a_sequence_classifier_equals_transformers(checkpoint, tmp_path):
    """Ministral3ForSequenceClassification (3 labels) on the tempered decoder: transformers' class probabilities at
    the last token (prompts of up to 13 tokens: past the threshold)."""
    from tests.runtime.hf_oracle import check_classifier_as_transformers

    check_classifier_as_transformers(checkpoint, tmp_path, PROMPTS)


def _read(config: dict):
    return model_config_from_hf(config, ministral3.SPEC, "float32")


def test_the_manifest_fields(checkpoint):
    """The temperature's fields checked on read (a floor, layers of the model) and each layer's share:
    every layer where query_temperature_layers is None, only those listed otherwise (Llama 4's NoPE layers)."""
    model = _read(read_hf_config(checkpoint))
    assert [model.query_temperature_of(i) for i in range(3)] == [(0.3, 8.0, 0.0)] * 3
    some = dataclasses.replace(model, query_temperature_offset=1.0, query_temperature_layers=[1])
    assert [some.query_temperature_of(i) for i in range(3)] == [None, (0.3, 8.0, 1.0), None]
    for changes in ({"query_temperature_floor": None}, {"query_temperature_layers": [3]}):
        with pytest.raises(ArtifactError, match="query_temperature_beta needs query_temperature_floor"):
            dataclasses.replace(model, **changes)


def test_config_read_as_transformers_reads_it(checkpoint):
    """Ministral3Config's default rope parameters (YaRN x16 over 16384, beta 0.1) where the config has none; no biases
    and one window on every layer whatever attention_bias and layer_types say; a config without the temperature's
    two keys refused by name."""
    from transformers import Ministral3Config

    assert spec_for_architecture("Ministral3ForCausalLM") is ministral3.SPEC
    base = read_hf_config(checkpoint)
    bare = _read({k: v for k, v in base.items() if k not in ("rope_parameters", "rope_scaling", "rope_theta")})
    theirs = Ministral3Config().rope_parameters
    assert (bare.rope_theta, bare.rope_scaling["factor"], bare.rope_scaling["original_max_position_embeddings"],
            bare.query_temperature_beta, bare.query_temperature_floor) == (
        theirs["rope_theta"], theirs["factor"], theirs["original_max_position_embeddings"],
        theirs["llama_4_scaling_beta"], float(theirs["original_max_position_embeddings"]))
    odd = _read({**base, "attention_bias": True, "sliding_window": 8,
                 "layer_types": ["full_attention", "sliding_attention"]})
    assert (odd.attention_bias, odd.sliding_window, odd.sliding_window_layers) == (False, 8, None)
    for key in ("llama_4_scaling_beta", "original_max_position_embeddings"):
        params = {k: v for k, v in MINISTRAL3_ROPE.items() if k != key}
        with pytest.raises(CheckpointError, match=f"llama_4_scaling_beta .*original_max_position_embeddings"):
            _read({**base, "rope_parameters": params})


def test_onnx_is_refused_by_name(checkpoint, tmp_path):
    """onnx-cpu: GroupQueryAttention has no per-position q scale; the message names what to do instead."""
    with pytest.raises(RecipeError, match="onnx-cpu: Ministral3ForCausalLM's query temperature .* use target.device"):
        build(recipe_from_dict({"model": str(checkpoint), "output": str(tmp_path / "o"),
                                "target": {"device": "onnx-cpu"}}), show_progress=False)


@torch.inference_mode()
def test_export_writes_the_temperature_and_imports_back(checkpoint, artifact, tmp_path, hf_logits, hf_encode):
    """`llmc export` of the float build: config.json's rope_parameters carry llama_4_scaling_beta, and transformers'
    Ministral3ForCausalLM on the export gives the checkpoint's logits (1e-5); an RTN W4 build's export imported
    back (`quantization.method: import`) is the same model and gives its logits exactly."""
    import json

    export_artifact(artifact, tmp_path / "float")
    config = json.loads((tmp_path / "float" / "config.json").read_text())
    assert config["model_type"] == "ministral3" and config["rope_parameters"]["llama_4_scaling_beta"] == 0.3
    token_ids = _score_ids(checkpoint, hf_encode)
    torch.testing.assert_close(hf_logits(tmp_path / "float", token_ids), hf_logits(checkpoint, token_ids), atol=1e-5,
                               rtol=1e-5)
    original = build_float32(checkpoint, tmp_path / "w4", target={"device": "cpu"},
                             quantization={"method": "rtn", "bits": 4, "group_size": 32, "report": False})
    export_artifact(original, tmp_path / "exported")
    reimported = build_float32(tmp_path / "exported", tmp_path / "reimported", target={"device": "cpu"},
                               quantization={"method": "import"})
    assert read_manifest(reimported).model == read_manifest(original).model
    scores = []
    for built in (original, reimported):
        with LLM(built, **ENGINE) as llm:
            scores.append(llm.engine.score(token_ids))
    torch.testing.assert_close(scores[0], scores[1], atol=0, rtol=0)


def test_inspect_says_the_temperature(artifact):
    result = CliRunner().invoke(cli, ["inspect", str(artifact)])
    assert result.exit_code == 0, result.output
    assert "q x 1 + 0.3 log(1 + floor(position / 8)) on every layer" in result.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", [True, False], ids=["cuda-graphs", "eager"])
def test_float32_on_the_gpu_matches_transformers(graphs, checkpoint, artifact, hf_greedy, hf_logits, hf_encode,
                                                 free_gpu):
    """On CUDA (the Triton rotary + KV-write, prefill and decode kernels; with CUDA graphs, whose replays compute the
    factor from their positions buffer): transformers' 16 greedy tokens of three prompts (positions past 8, 16, 24)
    and its logits at 50 positions (2e-3)."""
    with LLM(artifact, device="cuda", gpu_memory_utilization=0.3, max_num_seqs=3, max_num_batched_tokens=16,
             enforce_eager=not graphs) as llm:
        outputs = llm.generate([{"prompt_token_ids": hf_encode(checkpoint, p)} for p in PROMPTS], GREEDY)
        assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(checkpoint, PROMPTS, GREEDY.max_tokens)
        token_ids = _score_ids(checkpoint, hf_encode)
        torch.testing.assert_close(llm.engine.score(token_ids).cpu(), hf_logits(checkpoint, token_ids), atol=2e-3,
                                   rtol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_tensor_ranks_on_the_gpu_match_transformers(checkpoint, tmp_path, hf_greedy, hf_encode, free_gpu):
    """Two tensor ranks on two GPUs (CUDA graphs on each): transformers' greedy tokens of three prompts."""
    split = build_float32(checkpoint, tmp_path / "tp2", parallel={"tensor": 2})
    with LLM(split, device="cuda", gpu_memory_utilization=0.3, max_num_seqs=3, max_num_batched_tokens=16) as llm:
        outputs = llm.generate([{"prompt_token_ids": hf_encode(checkpoint, p)} for p in PROMPTS], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(checkpoint, PROMPTS, GREEDY.max_tokens)
