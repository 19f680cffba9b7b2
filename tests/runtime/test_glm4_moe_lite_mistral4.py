"""GLM-4.7-Flash (Glm4MoeLiteForCausalLM) and Mistral 4 (Mistral4ForCausalLM), DeepSeek-V3's layers under their own
configs, against transformers' own models (float32): logits at every position of a chunked prefill, greedy tokens and
their logprobs of prompts batched through the paged engine, on the CPU path and on the Triton path (the
latent-attention and fused-MoE kernels under TRITON_INTERPRET=1 on CPU tensors); their routers against transformers'
routers; RTN and GPTQ W4 builds against transformers holding their dequantized weights; how configs are read
(GLM-4.7-Flash's mlp_layer_types, Mistral 4's rope, query temperature and fused experts); Mistral-Small-4's
Mistral3ForConditionalGeneration form served as its language model; the refusals; -m gpu: CUDA (written, not run).
The GLM checkpoint carries a random e_score_correction_bias (transformers writes zeros), so the biased choice is
checked. Its MTP layer: tests/runtime/test_spec_mtp_glm4_moe_lite.py."""

import math
import os
import shutil

if not __import__("torch").cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported (triton reads it then)

import pytest
import torch
from safetensors import safe_open

from llmc.compiler.build import build
from llmc.compiler.export import export_artifact
from llmc.compiler.hf_checkpoint import model_config_from_hf, read_hf_config
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import ArtifactError, CheckpointError, RecipeError, RequestError
from llmc.runtime.artifact import read_manifest
from llmc.runtime.llm import LLM
from llmc.runtime.models import spec_for_architecture
from llmc.runtime.models.moe import deepseek_route
from tests.conftest import MLA_MOE_FAMILIES, make_hf_checkpoint, register_mistral4
from tests.runtime.hf_oracle import (assert_same_routes, build_float32, build_quantized, check_moe_build_as_oracle,
                                     float32_artifacts, write_config)
from tests.runtime.test_deepseek import _hf_state
from tests.runtime.test_deepseek import triton_dispatch  # noqa: F401 (a fixture)
from tests.runtime.test_glm4_moe import GREEDY, PROMPTS, _check, _random_score_bias, check_v3_router

register_mistral4()  # (transformers' AutoModelForCausalLM knows no Mistral 4 otherwise)
MOE_LAYER = {"glm4_moe_lite": 0, "mistral4": 1}  # (a sparse layer of each: mlp_layer_types, first_k_dense_replace)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mla_moe")
    made = {family: make_hf_checkpoint(root / family, family) for family in MLA_MOE_FAMILIES}
    _random_score_bias(made["glm4_moe_lite"], mtp=False)
    return made


@pytest.fixture(scope="module")
def artifacts(checkpoints, tmp_path_factory):
    return float32_artifacts(checkpoints, tmp_path_factory.mktemp("mla_moe_artifacts"))


@torch.inference_mode()
@pytest.mark.parametrize("family", MLA_MOE_FAMILIES)
def test_logits_greedy_and_logprobs_match_transformers(family, checkpoints, artifacts, hf_logits, hf_greedy,
                                                       hf_encode):
    with LLM(artifacts(family), device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        _check(llm, checkpoints[family], hf_logits, hf_greedy, hf_encode)
    assert read_manifest(artifacts(family)).model.family == family


@torch.inference_mode()
@pytest.mark.parametrize("family", MLA_MOE_FAMILIES)
def test_the_triton_path_matches_transformers(family, checkpoints, artifacts, triton_dispatch, hf_logits, hf_greedy,
                                              hf_encode):
    """The latent-attention kernel (absorbed, over the paged latent cache; Mistral 4's q tempered before it) and the
    fused MoE kernel (sigmoid or softmax routing weights) give transformers' logits, greedy tokens and logprobs."""
    with LLM(artifacts(family), device="cpu", max_num_seqs=2, max_num_batched_tokens=16, num_kv_blocks=64) as llm:
        _check(llm, checkpoints[family], hf_logits, hf_greedy, hf_encode, PROMPTS[:2])
    assert triton_dispatch["mla_attention"] and triton_dispatch["fused_moe"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
@pytest.mark.parametrize("family", MLA_MOE_FAMILIES)
def test_on_the_gpu(family, checkpoints, artifacts, hf_logits, hf_greedy, hf_encode, free_gpu):
    """The float32 artifacts on CUDA (Triton latent attention and fused MoE, CUDA graphs: Mistral 4's query
    temperature from the graphs' positions buffer): transformers' logits (2e-3, as the other MoE families' GPU tests),
    greedy tokens and logprobs."""
    with LLM(artifacts(family), device="cuda", gpu_memory_utilization=0.3, max_num_seqs=3,
             max_num_batched_tokens=16) as llm:
        assert all(layer.moe.runs_fused() for layer in llm.engine.runner.model.layers.values() if layer.is_moe)
        _check(llm, checkpoints[family], hf_logits, hf_greedy, hf_encode, tolerance=2e-3)


def test_the_routers_are_transformers_routers():
    """deepseek_route against transformers' Glm4MoeLiteTopkRouter (V3's: sigmoid, score bias, groups) and
    Mistral4TopkRouter (softmax top-k without a bias, renormalised or not, scaled; its groups all kept where topk_group
    is n_group, as the build reads them: no groups) on 512 random tokens: the same experts, the same weights."""
    from transformers import Glm4MoeLiteConfig, Mistral4Config
    from transformers.models.glm4_moe_lite.modeling_glm4_moe_lite import Glm4MoeLiteTopkRouter
    from transformers.models.mistral4.modeling_mistral4 import Mistral4TopkRouter

    check_v3_router(Glm4MoeLiteConfig, Glm4MoeLiteTopkRouter, (((4, 2), True, 1.8), ((1, 1), False, 1.0)), seed=1)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(512, 32, generator=gen)
    for groups, norm_topk_prob, scaling in (((1, 1), True, 1.0), ((4, 4), True, 2.5), ((1, 1), False, 1.5)):
        config = Mistral4Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=3, n_group=groups[0],
                                topk_group=groups[1], norm_topk_prob=norm_topk_prob, routed_scaling_factor=scaling)
        router = Mistral4TopkRouter(config)
        torch.nn.init.normal_(router.weight, generator=gen)
        with torch.no_grad():
            logits, want_weights, want_ids = router(x)
        weights, ids = deepseek_route(logits, 3, "softmax", None, None, None, norm_topk_prob, scaling)
        assert_same_routes(weights, ids, want_weights, want_ids)


@torch.inference_mode()
@pytest.mark.parametrize("family", MLA_MOE_FAMILIES)
@pytest.mark.parametrize("method", ["rtn", pytest.param("gptq", marks=pytest.mark.slow)])
def test_a_w4_build_runs_transformers_on_its_weights(family, method, checkpoints, tmp_path, hf_encode, data_dir):
    """A W4 build (every MLA linear, dense MLP, shared expert and expert; GPTQ calibrated through the layers) against
    transformers' model holding its dequantized weights: logits over 34 positions (1e-4) and 12 greedy tokens; with a
    sparse layer's experts reordered in transformers' copy the logits move."""
    checkpoint = checkpoints[family]
    out = build_quantized(checkpoint, tmp_path, data_dir, {"method": method, "bits": 4, "group_size": 32})
    layer = MOE_LAYER[family]
    modules = read_manifest(out).quant.modules
    assert {modules[f"layers.{layer}.{name}"]["format"] for name in ("attn.kv_b", "moe.experts.down")} == {"w4a16"}
    check_moe_build_as_oracle(out, checkpoint, _hf_state(out), hf_encode, PROMPTS, False, GREEDY.max_tokens,
                              moved_layer=layer)


@pytest.mark.slow
@pytest.mark.parametrize("family", MLA_MOE_FAMILIES)
def test_awq_folds_keep_the_function(family, checkpoints, tmp_path, data_dir, hf_encode, monkeypatch):
    """AWQ forced to fold random power-of-two scales into W8 layers (DeepSeek's MLA folds and the MoE's): the RTN W8
    build's logits, which holds only if every fold is undone where it is made."""
    from tests.runtime.hf_oracle import awq_and_rtn_logits

    token_ids = hf_encode(checkpoints[family], PROMPTS[1]) + list(range(100, 120))
    awq, rtn = awq_and_rtn_logits(checkpoints[family], tmp_path, token_ids, monkeypatch, data_dir, min_expert_tokens=1)
    torch.testing.assert_close(awq, rtn, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_mistral4_split_over_two_tensor_ranks_is_one_rank(checkpoints, artifacts, tmp_path, hf_encode):
    """Tensor parallel 2 (each rank its heads of q_b, kv_b and o, each tempering its own q; the experts split by
    columns, the softmax router whole): the one-rank artifact's greedy tokens and logits (5e-5, as DeepSeek's)."""
    from tests.runtime.hf_oracle import check_tensor_parallel

    split = check_tensor_parallel(checkpoints["mistral4"], artifacts("mistral4"), tmp_path, hf_encode, PROMPTS[:2],
                                  GREEDY, atol=5e-5)
    assert read_manifest(split).parallel.world_size == 2


# GLM-4.7-Flash's config.json keys at Glm4MoeLiteConfig's defaults (the published file was not read: no network here)
GLM_47_FLASH = {"architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite", "hidden_size": 2048,
                "num_hidden_layers": 47, "first_k_dense_replace": 1, "rope_theta": 1000000, "vocab_size": 154880,
                "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16"}


def test_configs_read_as_transformers_reads_them(checkpoints, caplog):
    """The tiny checkpoints' configs: GLM-4.7-Flash's sparse layers from mlp_layer_types, V3's router; Mistral 4's
    softmax router without groups, YaRN over the qk_rope_head_dim dims, its scale's mscale term, the query temperature
    (beta 0.3 over 8 positions); the parameters transformers counts. GLM-4.7-Flash's and Mistral 4's default configs
    (cut to 2 layers, on the meta device) count transformers' parameters too; Mistral 4's default rope is YaRN x128
    over 8192 with beta 0.1."""
    from transformers import AutoModelForCausalLM, Glm4MoeLiteConfig, Mistral4Config

    read = {family: model_config_from_hf(read_hf_config(checkpoints[family]),
                                         spec_for_architecture(read_hf_config(checkpoints[family])["architectures"][0]),
                                         "float32") for family in MLA_MOE_FAMILIES}
    glm, mistral = read["glm4_moe_lite"], read["mistral4"]
    assert (glm.moe_layers, glm.router_scoring, glm.router_groups, glm.router_topk_groups, glm.norm_topk_prob,
            glm.routed_scaling_factor, glm.v_head_dim, glm.head_dim) == ([0, 2], "sigmoid", 4, 2, True, 1.8, 16, 16)
    assert glm.mla_rope_interleave and glm.router_score_bias and glm.query_temperature_beta is None
    assert (mistral.moe_layers, mistral.router_scoring, mistral.router_groups, mistral.norm_topk_prob,
            mistral.routed_scaling_factor, mistral.router_score_bias) == ([1, 2], "softmax", None, True, 1.5, False)
    assert (mistral.query_temperature_beta, mistral.query_temperature_floor, mistral.rotary_dims) == (0.3, 8.0, 4)
    assert mistral.rope_scaling["rope_type"] == "yarn" and "partial_rotary_factor" not in mistral.rope_scaling
    assert math.isclose(mistral.softmax_scale, 16 ** -0.5 * (0.1 * math.log(32.0) + 1) ** 2)
    for family, config in read.items():
        assert config.num_parameters == AutoModelForCausalLM.from_pretrained(
            str(checkpoints[family])).num_parameters()
    flash = model_config_from_hf(GLM_47_FLASH, spec_for_architecture("Glm4MoeLiteForCausalLM"), "bfloat16")
    assert (flash.head_dim, flash.v_head_dim, flash.kv_lora_rank, flash.q_lora_rank, flash.num_experts,
            flash.num_experts_per_tok, flash.moe_layers[:2], len(flash.moe_layers), flash.rope_theta) == (
        256, 256, 512, 768, 64, 4, [1, 2], 46, 1e6)
    defaults = {"glm4_moe_lite": (Glm4MoeLiteConfig, {**GLM_47_FLASH, "num_hidden_layers": 2}),
                "mistral4": (Mistral4Config, {"architectures": ["Mistral4ForCausalLM"], "model_type": "mistral4",
                                              "num_hidden_layers": 2})}
    for config_class, short in defaults.values():
        ours = model_config_from_hf(short, spec_for_architecture(short["architectures"][0]), "bfloat16")
        with torch.device("meta"):
            count = AutoModelForCausalLM.from_config(config_class(**{
                k: v for k, v in short.items() if k not in ("architectures", "model_type")})).num_parameters()
        assert ours.num_parameters == count
        if config_class is Mistral4Config:
            assert (ours.rope_scaling["factor"], ours.rope_scaling["original_max_position_embeddings"],
                    ours.query_temperature_beta, ours.query_temperature_floor, ours.moe_layers) == (
                128.0, 8192, 0.1, 8192.0, [0, 1])
    with caplog.at_level("INFO", logger="llmc"):  # (transformers' Mistral 4 has no MTP layer)
        model_config_from_hf({**defaults["mistral4"][1], "num_nextn_predict_layers": 1}, spec_for_architecture(
            "Mistral4ForCausalLM"), "bfloat16")
    assert "Mistral 4: the multi-token prediction layers (num_nextn_predict_layers) are not built" in caplog.text


def test_mistral4s_experts_are_read_fused(checkpoints):
    """transformers 5 saves Mistral 4's experts fused (mlp.experts.gate_up_proj [E, 2 * width, hidden]), which the
    build reads as each expert's rows: the logits tests above run on them."""
    with safe_open(str(checkpoints["mistral4"] / "model.safetensors"), "pt") as f:
        assert "model.layers.1.mlp.experts.gate_up_proj" in f.keys()
        assert "model.layers.1.mlp.experts.0.gate_proj.weight" not in f.keys()


def _mistral3_wrapper(path) -> tuple:
    """A tiny random float32 Mistral3ForConditionalGeneration (Mistral-Small-4's form) whose language model is the
    tests' Mistral 4 (a one-layer Pixtral tower beside it), saved with the reference tokenizer; (path, the model)."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, Mistral4Config, PixtralVisionConfig

    from tests.conftest import _BASE_CONFIG, _FAMILY_SPECS, REF_MODEL_DIR, TOKENIZER_FILES
    from tests.runtime.test_llava import _randomise_

    text = Mistral4Config(**{**_BASE_CONFIG, **_FAMILY_SPECS["mistral4"][1]})
    vision = PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 head_dim=16, patch_size=8, image_size=64)
    model = Mistral3ForConditionalGeneration(Mistral3Config(vision_config=vision, text_config=text,
                                                            image_token_index=10, spatial_merge_size=2)).eval()
    _randomise_(model, 3)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copyfile(REF_MODEL_DIR / name, path / name)
    return path, model


@torch.inference_mode()
def test_mistral3s_wrapper_of_mistral4_serves_its_language_model(tmp_path, caplog):
    """Mistral3ForConditionalGeneration with a mistral4 text_config (weights under language_model.model.*, experts
    fused): its language model is built as Mistral4ForCausalLM (the tower not built, and the build says so), scored as
    transformers' Mistral3ForConditionalGeneration scores text (1e-4); an image in a request is refused by name."""
    from PIL import Image

    source, model = _mistral3_wrapper(tmp_path / "cg")
    with caplog.at_level("INFO", logger="llmc"):
        built = build_float32(source, tmp_path / "a")
    assert "the language model is built as Mistral4ForCausalLM, served as text" in caplog.text
    manifest = read_manifest(built)
    assert (manifest.model.architecture, manifest.model.family, manifest.vision) == (
        "Mistral4ForCausalLM", "mistral4", None)
    token_ids = list(range(100, 140))
    with LLM(built, device="cpu", num_kv_blocks=64) as llm:
        torch.testing.assert_close(llm.engine.score(token_ids), model(input_ids=torch.tensor([token_ids])).logits[0],
                                   atol=1e-4, rtol=1e-4)
        with pytest.raises(RequestError, match=r"this model \(Mistral4ForCausalLM\) takes no images"):
            llm.generate([{"prompt": "[IMG]", "multi_modal_data": {"image": Image.new("RGB", (16, 16))}}], GREEDY)


def test_what_they_refuse(checkpoints, artifacts, tmp_path):
    def refused(error, match, family, recipe=None, **changes):
        checkpoint = write_config(checkpoints[family], tmp_path / f"c{len(list(tmp_path.iterdir()))}", **changes) \
            if changes else checkpoints[family]
        with pytest.raises(error, match=match):
            build(recipe_from_dict({"model": str(checkpoint), "output": str(tmp_path / "out"), "dtype": "float32",
                                    **(recipe or {})}), show_progress=False)

    for family in MLA_MOE_FAMILIES:
        refused(RecipeError, "not exported to ONNX", family, recipe={"target": {"device": "onnx-cpu"}})
        refused(RecipeError, "quantization.method int8", family, recipe={"quantization": {"method": "int8"}})
        refused(CheckpointError, "attention_bias: true", family, attention_bias=True)
        rope = {**read_hf_config(checkpoints[family])["rope_parameters"], "partial_rotary_factor": 0.5}
        refused(CheckpointError, "partial_rotary_factor 0.5", family, rope_parameters=rope)
        architecture = read_manifest(artifacts(family)).model.architecture
        with pytest.raises(ArtifactError, match=f"architecture {architecture}; export writes"):
            export_artifact(artifacts(family), tmp_path / f"export_{family}")
    refused(CheckpointError, "first_k_dense_replace 1 disagrees with mlp_layer_types", "glm4_moe_lite",
            first_k_dense_replace=1)
    refused(CheckpointError, "mlp_layer_types", "glm4_moe_lite", mlp_layer_types=["sparse", "dense"])
    refused(CheckpointError, "scoring_func 'softmax'", "glm4_moe_lite", scoring_func="softmax")
    refused(CheckpointError, "scoring_func 'sigmoid'", "mistral4", scoring_func="sigmoid")
    refused(CheckpointError, "import is not supported for Mistral4ForCausalLM with fused experts", "mistral4",
            recipe={"quantization": {"method": "import"}})
    refused(CheckpointError, "n_group 4, topk_group 2: Mistral 4's group-limited routing", "mistral4", n_group=4,
            topk_group=2)
    rope = {k: v for k, v in read_hf_config(checkpoints["mistral4"])["rope_parameters"].items()
            if k != "llama_4_scaling_beta"}
    refused(CheckpointError, "llama_4_scaling_beta None", "mistral4", rope_parameters=rope)
