"""`llmc build`: recipe → artifact, as a list of named steps."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

import llmc
from llmc.compiler import gpt_oss_checkpoint
from llmc.compiler import hf_checkpoint as hf
from llmc.compiler.convert import (
    artifact_tensor_specs, dense_global_packer, dense_packer, global_modules, pack_global, pack_layer, read_global,
    read_layer,
)
from llmc.compiler.calibration import LayerRunner, calibration_windows, embed_windows
from llmc.compiler.emit import ShardedWriter, atomic_directory, prepare_output
from llmc.compiler.gguf_checkpoint import GGUFCheckpoint, GGUFTensorReader, is_gguf
from llmc.compiler.gguf_input import (
    GGUFImportPacker, gguf_import_formats, imported_tensors, llama3_rope, say_dequantized, stage_tokenizer,
)
from llmc.compiler.import_quantized import ImportPacker, checkpoint_quantization_config, import_formats
from llmc.compiler.onnx_export import DEFAULT_INT4_ACCURACY_LEVEL, check_onnx_recipe, export_onnx
from llmc.compiler.kernel_plan import plan_w4a16_kernels, tune_w4a16_shapes, w4a16_gemm_shapes
from llmc.compiler.kv_scales import KVScaleObserver, KVScales, checkpoint_kv_scales, fp8_max
from llmc.compiler.pipeline import QuantizingPacker
from llmc.compiler.quantize import kernel_layout, linear_in_features, plan_formats
from llmc.compiler.lora import LoraMerge, load_adapters
from llmc.compiler.mtp import MTP_FAMILIES, checkpoint_mtp, fp8_scale_name, num_mtp_layers, write_mtp_weights
from llmc.compiler.recipe import Recipe, check_adapters, check_output
from llmc.compiler.shard import order_down_groups, plan_parallel, shard_global, shard_layer
from llmc.compiler.vision import (check_vision_recipe, is_vision_model, qwen3_vl_moe_expert_tensors, text_only_config,
                                  vision_config, write_vision_weights)
from llmc.errors import CheckpointError, RecipeError
from llmc.quant.formats import INT_FORMAT_NAMES
from llmc.quant.import_config import parse_quantization_config
from llmc.runtime import artifact as art
from llmc.runtime import memory
from llmc.runtime import onnx_model as om
from llmc.runtime.layers.rotary import partial_rotary_problem
from llmc.runtime.models import model_context_of
from llmc.runtime.models.spec import ModelSpec, float32_norms
from llmc.runtime.options import max_model_len_problem, state_dtype_problem
from llmc.runtime.pooling import sentence_transformers_files
from llmc.runtime.parallel.layout import RankLayout, all_rank_layouts, padded_vocab_size

logger = logging.getLogger("llmc")

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "generation_config.json", "preprocessor_config.json", "processor_config.json",  # (a vision model's processor)
    "video_preprocessor_config.json",  # (Qwen2-VL's video processor)
)
DEFAULT_GPU_MEMORY_GIB = 80.0
NUM_REPORT_WINDOWS = 4  # held-out calibration windows the build's quality report runs on


@dataclass
class BuildResult:
    output: Path
    manifest: art.Manifest
    seconds: float
    stage_seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class _Context:
    """What the build steps hand each other."""

    recipe: Recipe
    model_dir: Path
    hf_config: dict
    spec: ModelSpec
    model: art.ModelConfig
    module_formats: dict[str, dict]
    parallel: art.ParallelPlan | None = None
    report: dict = field(default_factory=dict)
    w4a16_kernels: dict = field(default_factory=dict)  # the plan's kernel table (art.Plan.w4a16_kernels)
    kv_scales: KVScales | None = None  # FP8 KV scales, calibrated or imported (art.KVSpec)
    target: dict = field(default_factory=dict)  # art.Manifest.target: set by an ONNX build
    lora: LoraMerge | None = None  # the recipe's adapters, merged as the checkpoint's tensors are read
    derived: dict = field(default_factory=dict)  # tensors made from the checkpoint's (hf_checkpoint.TensorReader)
    vision: art.VisionSpec | None = None  # a LLaVA / Gemma 3 checkpoint's vision tower and projector (compiler/vision.py)
    gguf: GGUFCheckpoint | None = None  # a .gguf model (compiler/gguf_checkpoint.py); model_dir holds its tokenizer
    mtp: art.MtpSpec | None = None  # GLM-4.5's / DeepSeek-V3's MTP layer, built apart (compiler/mtp.py)


def _reader(ctx: _Context, merge=None, derived=None):
    """The checkpoint's tensors by HF name: a safetensors checkpoint's, or a GGUF file's (GGUFTensorReader)."""
    if ctx.gguf is not None:
        return GGUFTensorReader(ctx.gguf, ctx.model_dir, merge=merge, derived=derived)
    return hf.TensorReader(ctx.model_dir, merge=merge, derived=derived)


def build(recipe: Recipe, show_progress: bool = True) -> BuildResult:
    """Build the artifact a recipe describes, atomically, and return its manifest."""
    start = time.perf_counter()
    timings: dict[str, float] = {}
    check_output(recipe)  # again: `llmc build -o` and build(replace(recipe, output=...)) change it after parsing
    check_adapters(recipe)  # and `llmc build --adapter`
    prepare_output(recipe.output_dir, create=False)  # a bad output fails before any work; killed builds' debris goes
    _check_tuning(recipe)
    check_onnx_recipe(recipe)
    # a GGUF model's tokenizer files, for the build's length
    with tempfile.TemporaryDirectory(prefix="llmc-gguf-") if is_gguf(recipe.model) else nullcontext() as staging:
        ctx = _timed(timings, "read checkpoint", lambda: _read_checkpoint(recipe, staging and Path(staging)))
        return _build(ctx, recipe, timings, start, show_progress)


def _build(ctx: _Context, recipe: Recipe, timings: dict, start: float, show_progress: bool) -> BuildResult:
    _resolve_runtime(recipe, ctx.model)  # a max_model_len the model cannot take fails before any quantization
    _check_calibration_seq_len(recipe, ctx.model)
    _check_hybrid(ctx)  # (first: a hybrid MoE's refusal names what a hybrid builds with, not what an MoE does)
    _check_moe(ctx)
    _check_mla(ctx)
    _check_onnx_norms(ctx)
    _check_onnx_temperature(ctx)
    _check_onnx_qk_l2_norm(ctx)
    _check_int8(ctx)
    _check_partial_rotary(ctx)
    _check_gateless_mlp(ctx)
    _check_pooling(ctx)
    ctx.lora = _timed(timings, "read adapters", lambda: _read_adapters(ctx)) if recipe.adapter else None
    ctx.mtp = _plan_mtp(ctx)
    ctx.module_formats = _plan_formats(ctx)
    ctx.parallel = _plan_parallel(ctx)
    ctx.w4a16_kernels = _plan_kernels(ctx, timings)
    output = recipe.output_dir
    with atomic_directory(output) as tmp:
        _timed(timings, "tokenizer", lambda: _copy_tokenizer(ctx.model_dir, tmp / art.TOKENIZER_DIR))
        weight_bytes = _timed(timings, "weights", lambda: _write_weights(ctx, tmp, show_progress))
        if ctx.vision is not None:
            _timed(timings, "vision", lambda: _write_vision(ctx, tmp))
        if ctx.mtp is not None:
            _timed(timings, "mtp layer", lambda: write_mtp_weights(ctx.model_dir, ctx.spec, ctx.model, ctx.mtp,
                                                                   tmp / art.MTP_WEIGHTS, ctx.lora, _fp8_block(ctx)))
        if recipe.target.device in om.ONNX_DEVICES:
            weight_bytes = _timed(timings, "onnx graph", lambda: _write_onnx(ctx, tmp))
        manifest = _timed(timings, "manifest", lambda: _write_manifest(ctx, tmp, weight_bytes))
    return BuildResult(output, manifest, time.perf_counter() - start, timings)


def _plan_mtp(ctx: _Context) -> art.MtpSpec | None:
    """GLM-4.5's, DeepSeek-V3's or GLM-4.7-Flash's MTP layer where its checkpoint has one (compiler/mtp.py); not from
    a GGUF file, nor into an ONNX build, nor where an imported checkpoint holds it in integers (packed or int8): logged.
    An import's FP8 layer (DeepSeek-V3 / R1 publish theirs in 128 x 128 blocks) is dequantized with its scales and
    written dense. Qwen3-Next's, Qwen3.5's and Nemotron-H's (mtp.*, or Nemotron-H's num_nextn_predict_layers) are not
    built: logged."""
    if ctx.spec.family in ("qwen3_5", "qwen3_5_moe", "qwen3_next", "nemotron_h") and ctx.gguf is None:
        with hf.TensorReader(ctx.model_dir) as reader:
            mtp = [name for name in reader.names() if name.startswith("mtp.")]
        if mtp:  # (Qwen3-Next's and Qwen3.5's published checkpoints hold one; transformers skips it too)
            logger.info("%s: the checkpoint's multi-token prediction layer (%d mtp.* tensors) is not built; no MTP "
                        "speculative decoding", ctx.spec.family, len(mtp))
        elif ctx.hf_config.get("num_nextn_predict_layers"):  # (Nemotron-H's config names them; transformers runs none)
            logger.info("%s: num_nextn_predict_layers %d: the multi-token prediction layers are not built; no MTP "
                        "speculative decoding", ctx.spec.family, ctx.hf_config["num_nextn_predict_layers"])
    if ctx.spec.family not in MTP_FAMILIES or not num_mtp_layers(ctx.hf_config):
        return None
    family = MTP_FAMILIES[ctx.spec.family]
    if ctx.gguf is not None or ctx.recipe.target.device in om.ONNX_DEVICES:
        logger.info("%s: the multi-token prediction layer is not built into %s; no MTP speculative decoding", family,
                    "a build from a GGUF file" if ctx.gguf is not None else "an ONNX build")
        return None
    with hf.TensorReader(ctx.model_dir) as reader:
        prefix = f"{ctx.spec.hf_layer_prefix}{ctx.model.num_layers}."
        names = [name for name in reader.names() if name.startswith(prefix)]
        fp8 = [name for name in names if reader.dtype_name(name).startswith("F8")]
        integer = [name for name in names if reader.dtype_name(name).startswith(("I", "U"))
                   or name in fp8 and fp8_scale_name(reader, name) is None]
        if integer:
            logger.info("%s: the checkpoint's multi-token prediction layer is quantized (%s), not in FP8 with its "
                        "scales; it is not built from an import; no MTP speculative decoding", family, integer[0])
            return None
        if fp8:
            logger.info("%s: the checkpoint's multi-token prediction layer is FP8 (%d weights, %s first): dequantized "
                        "with its scales", family, len(fp8), fp8[0])
        return checkpoint_mtp(reader, ctx.spec, ctx.model, ctx.hf_config)


def _fp8_block(ctx: _Context) -> tuple[int, int] | None:
    """The block size of an imported FP8 checkpoint's weight scales (None: per tensor or per channel, or no import)."""
    qc = checkpoint_quantization_config(ctx.hf_config, ctx.model_dir) if ctx.recipe.quantization.method == "import" \
        else None
    return parse_quantization_config(qc).block_size if qc else None


def _timed(timings: dict, stage: str, fn):
    start = time.perf_counter()
    logger.info("build: %s", stage)
    result = fn()
    timings[stage] = time.perf_counter() - start
    return result


def _read_checkpoint(recipe: Recipe, staging: Path | None) -> _Context:
    """The checkpoint's config, model spec and ModelConfig, checked; a GGUF model's tokenizer staged in `staging`."""
    gguf = GGUFCheckpoint(Path(recipe.model)) if is_gguf(recipe.model) else None
    if gguf is not None:
        stage_tokenizer(gguf, recipe.tokenizer, staging, TOKENIZER_FILES)
    model_dir = staging if gguf is not None else resolve_model_dir(recipe)
    hf_config = {**(gguf.config if gguf is not None else hf.read_hf_config(model_dir)), **recipe.hf_overrides}
    vision = None
    text_only = text_only_config(hf_config)  # (Mistral 3's wrapper of a Mistral 4: its language model, as text)
    if text_only is not None:
        hf_config = text_only
    elif is_vision_model(hf_config):  # the language model is built as its causal LM (compiler/vision.py)
        check_vision_recipe(recipe)
        hf_config, vision = vision_config(hf_config, model_dir)
    spec = hf.model_spec_for(hf_config, model_dir)
    biased = hf_config.get("mlp_bias") or (spec.family == "llama" and hf_config.get("attention_bias"))
    # Granite's, Seed-OSS's, Bamba's, Nemotron-H's, Falcon-H1's, Arcee's and Apertus's biases: refused by name in
    # model_config_from_hf
    if biased and spec.family not in (*hf.GRANITE_FAMILIES, "seed_oss", "bamba", "nemotron_h", "falcon_h1",
                                      *hf.UP_MLP_FAMILIES):
        raise CheckpointError(f"{model_dir}: Llama checkpoints with attention_bias or mlp_bias are not supported")
    if spec.family in hf.GRANITE_FAMILIES and recipe.quantization.method == "import":
        raise CheckpointError(f"{model_dir}: quantization.method import is not supported for Granite: the build folds "
                              "its residual_multiplier and logits_scaling into the o_proj/down_proj and final norm "
                              "weights as it reads them, which a pre-quantized checkpoint's packed weights do not "
                              "take; quantize the float checkpoint with rtn, gptq, awq or fp8")
    qc = checkpoint_quantization_config(hf_config, model_dir) or {}
    if spec.family == "gpt_oss":
        _check_gpt_oss(recipe, model_dir, qc)
    quant_method = str(qc.get("quant_method", "")).lower()
    if recipe.quantization.method != "import" and (quant_method == "fp8" or quant_method.startswith("modelopt") or (
            qc.get("quant_method") == "compressed-tensors" and qc.get("config_groups"))):
        # their linears' `.weight` holds FP8 or int8 levels, which a float read would take for weights
        raise CheckpointError(f"{model_dir}: the checkpoint is quantized (quantization_config quant_method "
                              f"{qc['quant_method']!r}) and quantization.method {recipe.quantization.method} reads "
                              "float weights; build it with quantization.method: import")
    if spec.family == "ernie4_5_moe" and recipe.quantization.method == "import":
        raise CheckpointError(f"{model_dir}: quantization.method import is not supported for ERNIE 4.5 MoE (its router's "
                              "mlp.moe_statics bias and permuted q/k rows are not read from a quantized checkpoint); "
                              "quantize the float checkpoint with rtn, gptq, awq or fp8")
    if spec.family in ("glm4", "glm4_moe", "cohere", "cohere2", "ernie4_5", "minimax_m2") and \
            recipe.quantization.method == "import":
        _check_permuted_import(spec, model_dir, qc, gguf is not None)
    if spec.family == "minimax_m2" and hf_config.get("num_mtp_modules"):  # (MiniMax-M2's config: use_mtp, 3 modules)
        logger.info("MiniMax-M2: the checkpoint's %d multi-token-prediction modules (num_mtp_modules) are not built; "
                    "the model runs without them (no speculative method mtp)", hf_config["num_mtp_modules"])
    if spec.family in ("qwen3", "qwen3_moe", "dots1") and hf_config.get("attention_bias"):  # o_proj has a bias then too
        raise CheckpointError(f"{model_dir}: {spec.family} checkpoints with attention_bias (an o_proj bias) are not "
                              "supported")
    if gguf is None:
        reader = hf.TensorReader(model_dir)  # fails early on missing or pickle-only weights
        if spec.family == "gpt_oss":
            gpt_oss_checkpoint.say_dequantized(reader, recipe.quantization.method)
    _tokenizer_files(model_dir)
    dtype = recipe.dtype
    if dtype == "auto":
        dtype = hf.checkpoint_dtype(hf_config)
        if spec.family == "gpt_oss" and gguf is None and not (hf_config.get("torch_dtype") or hf_config.get("dtype")):
            dtype = gpt_oss_checkpoint.stored_dtype(reader, spec)
    model = hf.model_config_from_hf(hf_config, spec, dtype)
    if gguf is not None:
        model = llama3_rope(gguf, model)
        method = recipe.quantization.method
        say_dequantized(gguf, imported_tensors(gguf) if method == "import" else set(), model.dtype, method)
    model = _merge_generation_eos(model, model_dir)
    if spec.moe and spec.moe.fused and recipe.quantization.method == "import":  # (Granite MoE: refused above too)
        raise CheckpointError(f"{model_dir}: quantization.method import is not supported for {model.architecture} (its "
                              "fused experts); quantize the float checkpoint with rtn, gptq, awq or fp8")
    if spec.family in ("glm4_moe_lite", "mistral4") and recipe.quantization.method == "import" and gguf is None \
            and _fused_experts(reader, spec, model):
        raise CheckpointError(f"{model_dir}: quantization.method import is not supported for {model.architecture} with "
                              "fused experts (mlp.experts.gate_up_proj); quantize the float checkpoint with rtn, gptq, "
                              "awq or fp8")
    if vision is not None and spec.family == "qwen3_moe" and recipe.quantization.method == "import":
        raise CheckpointError(f"{model_dir}: quantization.method import is not supported for Qwen3-VL-MoE (its fused "
                              "experts); quantize the float checkpoint with rtn, gptq, awq or fp8")
    derived = (_derived_tensors(hf_config, spec, model, model_dir) | hf.fused_expert_tensors(spec, model)
               | hf.qwen3_next_tensors(spec, model)
               | hf.olmo_hybrid_tensors(spec, model, set(reader.names()) if gguf is None else set())
               | gpt_oss_checkpoint.expert_tensors(spec, model)
               | (qwen3_vl_moe_expert_tensors(reader, spec, model) if vision is not None and spec.family == "qwen3_moe"
                  or spec.family in ("qwen3_5_moe", "qwen3_next", "glm4_moe_lite", "mistral4") and gguf is None
                  and _fused_experts(reader, spec, model)
                  else {}))  # (Qwen3-VL-MoE: its language model is the only Qwen3-MoE with a vision side)
    return _Context(recipe, model_dir, hf_config, spec, model, {}, derived=derived, vision=vision, gguf=gguf)


def _fused_experts(reader, spec: ModelSpec, model: art.ModelConfig) -> bool:
    """Whether a Qwen3.5-MoE / Qwen3-Next / GLM-4.7-Flash / Mistral 4 checkpoint holds each layer's experts fused
    (mlp.experts.gate_up_proj / down_proj, as transformers 5 holds them; Mistral 4's save_pretrained writes them so)
    rather than under per-expert names (what save_pretrained writes for the others)."""
    layers = model.moe_layers
    return bool(layers) and reader.has(f"{spec.hf_layer_prefix}{layers[0]}.mlp.experts.gate_up_proj")


def _check_permuted_import(spec: ModelSpec, model_dir: Path, qc: dict, is_gguf: bool) -> None:
    """GLM-4, GLM-4.5, Cohere, ERNIE 4.5, MiniMax-M2: the build permutes q_proj's and k_proj's rows into the runtime's
    rotary layout as it reads them. An FP8 checkpoint's rows move with their scales (compiler/import_quantized.py);
    packed integer weights (GPTQ, AWQ, compressed-tensors ints, int8, GGUF blocks) do not take the permutation: refused."""
    what = "a GGUF file" if is_gguf else None
    if what is None and qc:
        ispec = parse_quantization_config(qc)
        what = None if ispec.is_fp8 else f"{ispec.method} {ispec.layout} weights"
    if what is not None:
        raise CheckpointError(f"{model_dir}: quantization.method import is not supported for {spec.architectures[0]} "
                              f"from {what}: the build permutes q_proj's and k_proj's rows into the "
                              "runtime's rotary layout as it reads them, which packed integer weights do not take (FP8 "
                              "checkpoints import); quantize the float checkpoint with rtn, gptq, awq or fp8")


def _check_gpt_oss(recipe: Recipe, model_dir: Path, qc: dict) -> None:
    """What a gpt-oss build does not do, refused by name (its quantization_config: mxfp4 or none)."""
    if recipe.quantization.method == "import":
        raise CheckpointError(f"{model_dir}: quantization.method import is not supported for gpt-oss (its fused, "
                              "interleaved experts; MXFP4 is no format llmc runs): build with none, rtn, gptq, awq or "
                              "fp8, which read its MXFP4 experts dequantized")
    gpt_oss_checkpoint.check_quantization_config(qc, model_dir)


def _derived_tensors(hf_config: dict, spec: ModelSpec, model: art.ModelConfig, model_dir: Path) -> dict:
    """The tensors the build makes from the checkpoint's (hf_checkpoint.TensorReader's derived): a causal LM
    converted into a classifier (classifier_from_token) gets its `score` from its LM head's rows of the tokens."""
    from_tokens = hf.classifier_from_token(hf_config)
    if from_tokens is None:
        return {}
    tokens, method = from_tokens
    if model.final_logit_softcapping is not None:
        raise CheckpointError(f"classifier_from_token: {model.architecture} soft-caps its logits, which a linear "
                              "score head cannot carry; use a checkpoint without final_logit_softcapping")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    token_ids = [tokenizer.convert_tokens_to_ids(token) for token in tokens]
    unknown = [t for t, i in zip(tokens, token_ids) if i is None or i == tokenizer.unk_token_id or i >= model.vocab_size]
    if unknown:
        raise CheckpointError(f"classifier_from_token: {unknown} not in the tokenizer's vocabulary (give tokens as the "
                              "vocabulary spells them, e.g. 'Ġyes' for a byte-level BPE)")
    head = spec.global_tensors["embed.weight" if model.tie_word_embeddings else "lm_head.weight"]
    logger.info("classifier_from_token %s (%s): score = the LM head's rows of token ids %s", tokens, method, token_ids)
    return {spec.global_tensors["score.weight"]:
            lambda reader: hf.score_from_token_rows(reader.get(head), token_ids, method)}


def _check_moe(ctx: _Context) -> None:
    """What a mixture-of-experts build does not do yet, refused by name before any work."""
    if not ctx.model.moe_layers:
        return
    if ctx.recipe.target.device in om.ONNX_DEVICES:
        raise RecipeError(f"target.device {ctx.recipe.target.device}: mixture-of-experts models ({ctx.model.architecture}) "
                          "are not exported to ONNX; use target.device cuda or cpu")


def _check_mla(ctx: _Context) -> None:
    """What a DeepSeek build (multi-head latent attention: runtime/models/mla.py) does not do, refused by name before
    any work: ONNX graphs and w8a8-int8 (not verified on it; refused for MoE layers anyway)."""
    model, recipe = ctx.model, ctx.recipe
    if not model.is_mla:
        return
    name, quant = model.architecture, recipe.quantization
    if recipe.target.device in om.ONNX_DEVICES:
        raise RecipeError(f"target.device {recipe.target.device}: {name}'s latent attention is not exported to ONNX; "
                          "use target.device cuda or cpu")
    if quant.method == "int8":  # (refused for its MoE layers too)
        raise RecipeError(f"quantization.method int8: not supported for {name} (no verified w8a8-int8 path for its "
                          "latent attention); use rtn, gptq, awq or fp8, or import a quantized checkpoint")


def _check_onnx_norms(ctx: _Context) -> None:
    """Cohere's LayerNorm and parallel block have no form in the onnx-cpu graph yet: refused by name before any work."""
    model = ctx.model
    if ctx.recipe.target.device in om.ONNX_DEVICES and (model.layer_norm or model.parallel_block):
        raise RecipeError(f"target.device {ctx.recipe.target.device}: {model.architecture}'s LayerNorm and parallel "
                          "attention + MLP block are not exported to ONNX; use target.device cpu or cuda")


def _check_onnx_temperature(ctx: _Context) -> None:
    """A query temperature (Ministral 3's llama_4_scaling_beta) has no form in the onnx-cpu graph (its
    GroupQueryAttention rotates q itself, with no per-position scale): refused by name before any work."""
    model, device = ctx.model, ctx.recipe.target.device
    if device in om.ONNX_DEVICES and model.query_temperature_beta is not None:
        raise RecipeError(f"target.device {device}: {model.architecture}'s query temperature (q scaled by position) is "
                          "not exported to ONNX; use target.device cpu or cuda")


def _check_onnx_qk_l2_norm(ctx: _Context) -> None:
    """Llama 4's weightless q/k norm (qk_l2_norm_layers) has no form in the onnx-cpu graph: refused by name (its MoE
    layers are refused there too, _check_moe)."""
    model, device = ctx.model, ctx.recipe.target.device
    if device in om.ONNX_DEVICES and model.qk_l2_norm_layers:
        raise RecipeError(f"target.device {device}: {model.architecture}'s weightless q/k norm (use_qk_norm) is not "
                          "exported to ONNX; use target.device cpu or cuda")


HYBRID_QUANT_METHODS = ("none", "rtn", "gptq", "fp8", "import")
GATELESS_QUANT_METHODS = ("none", "rtn", "gptq")  # an MLP without gate (_check_gateless_mlp)
# the hybrid families that import quantized checkpoints (FP8 ones, without experts: _check_hybrid), as tested; not yet:
# Qwen3-Next (the build regroups its fused in_proj_qkvz rows as it reads them), Falcon-H1 and Granite 4.0 (their
# multipliers fold into the weights as they are read), the MoE hybrids' experts, Bamba, LFM2, OLMo Hybrid
HYBRID_IMPORTS = ("qwen3_5", "nemotron_h")


def _check_hybrid(ctx: _Context) -> None:
    """A hybrid model (Qwen3.5's Gated DeltaNet layers, runtime/models/gated_deltanet.py; Granite 4.0's Mamba-2 layers,
    runtime/models/mamba2.py; LFM2's short-conv layers, runtime/models/short_conv.py) runs on one rank of the torch
    runtime, dense, with int weights from RTN or GPTQ, or FP8 W8A8 (its linears; the state layers' conv, gates and
    norms stay dense), built or (HYBRID_IMPORTS) imported from an FP8 checkpoint: the rest is refused by name before
    any work."""
    model, recipe = ctx.model, ctx.recipe
    if not model.is_hybrid:
        return
    kind = "Mamba-2" if model.mamba_layers else "short-conv" if model.short_conv_layers else "Gated DeltaNet"
    name = f"{model.architecture} (a hybrid model with {kind} layers)"
    if recipe.target.device in om.ONNX_DEVICES:
        raise RecipeError(f"target.device {recipe.target.device}: {name} is not exported to ONNX; use target.device "
                          "cpu or cuda")
    if recipe.parallel.tensor > 1 or recipe.parallel.pipeline > 1:
        raise RecipeError(f"parallel: {name} runs on one rank; set parallel.tensor and parallel.pipeline to 1")
    if recipe.quantization.method not in HYBRID_QUANT_METHODS:
        raise RecipeError(f"quantization.method {recipe.quantization.method}: {name} builds with "
                          f"{', '.join(HYBRID_QUANT_METHODS)}; use one of them")
    if recipe.quantization.method == "import":
        qc, what = ctx.hf_config.get("quantization_config"), None
        if model.family not in HYBRID_IMPORTS or model.moe_layers:
            what = "a quantized checkpoint (tested: Qwen3.5's and Nemotron-H's FP8 ones, without experts)"
        elif qc and not (ispec := parse_quantization_config(qc)).is_fp8:
            what = f"{ispec.method} {ispec.layout} weights"
        if what is not None:
            raise CheckpointError(f"{ctx.model_dir}: quantization.method import is not supported for {name} from "
                                  f"{what}; quantize the float checkpoint with rtn, gptq or fp8")


def _check_gateless_mlp(ctx: _Context) -> None:
    """An MLP without gate (Arcee's relu2, Apertus's xielu: mlp.up, not mlp.gate_up) runs on the torch runtime, dense
    or with int weights from RTN or GPTQ: the ONNX graph, AWQ's and SmoothQuant's folds and imports name a gate_up
    (and AWQ's fold of down into up would need an activation linear in up), FP8 and int8 are not tested without one:
    refused by name before any work."""
    model, recipe = ctx.model, ctx.recipe
    if model.gated_mlp or model.is_hybrid:  # (a hybrid's: _check_hybrid)
        return
    name = f"{model.architecture} (an MLP without gate, hidden_act {model.hidden_act})"
    if recipe.target.device in om.ONNX_DEVICES:
        raise RecipeError(f"target.device {recipe.target.device}: {name} is not exported to ONNX; use target.device "
                          "cpu or cuda")
    if recipe.quantization.method not in GATELESS_QUANT_METHODS:
        raise RecipeError(f"quantization.method {recipe.quantization.method}: {name} builds with "
                          f"{', '.join(GATELESS_QUANT_METHODS)}; use one of them")


def _check_pooling(ctx: _Context) -> None:
    """The recipe's runner / convert against the model, now that the checkpoint says whether it is a sequence
    classifier (the recipe's own check could not know)."""
    from llmc.runtime.pooling import pooling_problem

    recipe = ctx.recipe
    world_size = recipe.parallel.tensor * recipe.parallel.pipeline
    if problem := pooling_problem(recipe.runtime, world_size, ctx.model):
        raise RecipeError(f"runtime.{problem}")
    if ctx.model.is_classifier and recipe.runtime.speculative is not None:
        raise RecipeError(f"runtime.speculative: {ctx.model.architecture} is a sequence classifier, which samples "
                          "nothing to speculate; drop it")


def _check_int8(ctx: _Context) -> None:
    """What method int8 (w8a8-int8) does not do yet, refused by name before any work."""
    quant = ctx.recipe.quantization
    if quant.method != "int8":
        return
    if ctx.model.moe_layers:
        raise RecipeError(f"quantization.method int8: mixture-of-experts models ({ctx.model.architecture}) have no "
                          "w8a8-int8 experts yet; use rtn, gptq, awq or fp8")
    if quant.smoothquant and not ctx.model.pre_norms:
        raise RecipeError(f"quantization.smoothquant: {ctx.model.architecture} has no norm before qkv and gate_up "
                          "(its norms follow the sub-layers) to fold the smoothing into; set smoothquant: null")
    if quant.smoothquant and ctx.model.parallel_block:
        raise RecipeError(f"quantization.smoothquant: {ctx.model.architecture}'s qkv and gate_up read one norm, which "
                          "takes no two smoothings; set smoothquant: null")


def _check_partial_rotary(ctx: _Context) -> None:
    """A partial rotary (Phi-4-mini's partial_rotary_factor) runs on a CPU, torch or onnx-cpu: a cuda target (the
    default) is refused by name before any work, as the engine refuses the artifact on CUDA; so is an onnx-cpu one
    whose rotated dims GroupQueryAttention does not take (a multiple of 16, its cos_cache width a multiple of 8)."""
    model, device = ctx.model, ctx.recipe.target.device
    if problem := partial_rotary_problem(model, device):
        raise RecipeError(f"target.device {device}: {problem}")
    if model.is_partial_rotary and device in om.ONNX_DEVICES and model.rotary_dims % 16:
        raise RecipeError(f"target.device {device}: {model.architecture} rotates {model.rotary_dims} of each head's "
                          f"{model.head_dim} dims; onnxruntime's GroupQueryAttention rotates a multiple of 16 "
                          "(its cos_cache width a multiple of 8); use target.device cpu")


def _reading_merge(ctx: _Context):
    """What the build's reader does to a tensor as it is read: the recipe's LoRA adapters merged, then a
    (1 + w) norm folded (hf_checkpoint.norm_fold, Gemma), then Granite's residual and logits multipliers folded
    (hf_checkpoint.multiplier_fold: after the merge, so the adapter's delta is scaled with the weight it joins), then
    GLM-4's, GLM-4.5's, Cohere's and ERNIE 4.5's q/k rows permuted into the runtime's rotary layout
    (hf_checkpoint.rotary_fold: after the merge, so the adapter's delta moves with its rows); None when none applies."""
    steps = [step for step in (ctx.lora, hf.norm_fold(ctx.spec, ctx.model),
                               hf.multiplier_fold(ctx.spec, ctx.model, ctx.hf_config),
                               hf.rotary_fold(ctx.spec, ctx.model)) if step is not None]
    if len(steps) <= 1:
        return steps[0] if steps else None

    def merge(name, tensor):
        for step in steps:
            tensor = step(name, tensor)
        return tensor
    return merge


def _read_adapters(ctx: _Context) -> LoraMerge | None:
    """The recipe's LoRA adapters, checked against the checkpoint before any work (compiler/lora.py)."""
    with _reader(ctx) as reader:
        return load_adapters(ctx.recipe.adapter, reader, ctx.spec, ctx.model, ctx.hf_config,
                             ctx.recipe.quantization.method)


def resolve_model_dir(recipe: Recipe) -> Path:
    """A local directory as is; a hub id through huggingface_hub (a one-line error when offline)."""
    if not recipe.is_hub_id:
        return Path(recipe.model)
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(
            recipe.model, revision=recipe.revision,
            allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.txt", "*.model"],
        )
    except Exception as e:  # noqa: BLE001 - any hub failure becomes one line for the user
        raise RecipeError(
            f"model: {recipe.model!r} is not a local directory (no {Path(recipe.model).absolute()}: relative "
            f"paths start at the current directory) and could not be fetched from the Hugging Face Hub as a "
            f"hub id ({type(e).__name__}); download it and set model to its path"
        ) from None
    return Path(path)


def _merge_generation_eos(model: art.ModelConfig, model_dir: Path) -> art.ModelConfig:
    # Chat models often list extra end tokens (e.g. <|eot_id|>) only in generation_config.json. (The
    # tokenizer's eos, the model's own in vLLM, is put first by the engine, from the artifact's tokenizer.)
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return model
    eos = json.loads(path.read_text()).get("eos_token_id")
    extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
    merged = list(dict.fromkeys([*model.eos_token_ids, *extra]))
    return dataclasses.replace(model, eos_token_ids=merged)


def _plan_formats(ctx: _Context) -> dict[str, dict]:
    if ctx.recipe.quantization.method == "import" and ctx.gguf is not None:
        formats = gguf_import_formats(ctx.gguf, ctx.spec, ctx.model)
    elif ctx.recipe.quantization.method == "import":
        formats = import_formats(ctx.hf_config, ctx.spec, ctx.model, ctx.model_dir)
    else:
        in_features = linear_in_features(ctx.spec, ctx.model)
        formats = plan_formats(ctx.recipe.quantization, ctx.spec, ctx.model, in_features)
    planned = {module: kernel_layout(spec, ctx.recipe.target.device, ".experts." in module)
               for module, spec in formats.items()}
    _say_dequantized_on_cuda(planned, ctx.recipe.target.device, ctx.model.dtype)
    return planned


def _say_dequantized_on_cuda(formats: dict[str, dict], device: str, dtype: str) -> None:
    """One line when a CUDA artifact holds integer linears no GPU kernel reads (w3a16, w8a16, experts
    with act-order g_idx): those run dequantized on every forward."""
    if device != "cuda":
        return
    plain = [spec["format"] + (" with act-order g_idx" if spec.get("has_g_idx") else "") for spec in formats.values()
             if spec["format"] in INT_FORMAT_NAMES.values() and spec.get("layout") != "gpu"]
    if plain:
        logger.warning("%d linears (%s) have no GPU kernel: on cuda they are dequantized to %s on every forward, "
                       "slower than unquantized weights; quantize to 4 bits for the W4A16 kernels",
                       len(plain), ", ".join(sorted(set(plain))), dtype)


def _plan_parallel(ctx: _Context) -> art.ParallelPlan:
    tensor_bytes = [(name, _num_bytes(dtype, shape)) for name, dtype, shape in artifact_tensor_specs(ctx.model, ctx.module_formats)]
    return plan_parallel(ctx.recipe.parallel, ctx.model, ctx.spec, ctx.module_formats, tensor_bytes)


def _check_tuning(recipe: Recipe) -> None:
    """tune_kernels measures on this machine's GPU for a CUDA target: refuse it up front otherwise."""
    if not recipe.target.tune_kernels:
        return
    if recipe.target.device != "cuda":
        raise RecipeError("target.tune_kernels: only a cuda target runs the W4A16 kernels; "
                          "set target.device: cuda or tune_kernels: false")
    if not torch.cuda.is_available():
        raise RecipeError("target.tune_kernels: true needs a CUDA GPU on the build machine (none is visible); "
                          "build on the target GPU, or set tune_kernels: false to record the H100 table and heuristic")


def _plan_kernels(ctx: _Context, timings: dict) -> dict:
    """The W4A16 kernel per GEMM shape of this artifact (empty without w4a16 linears in the gpu layout)."""
    shapes = w4a16_gemm_shapes(ctx.model, ctx.parallel, ctx.module_formats)
    if not shapes:
        if ctx.recipe.target.tune_kernels:
            logger.info("target.tune_kernels: no w4a16 linear in the gpu layout, nothing to tune")
        return {}
    measured = {}
    if ctx.recipe.target.tune_kernels:
        dtype = getattr(torch, ctx.model.dtype)
        measured = _timed(timings, "tune kernels", lambda: tune_w4a16_shapes(shapes, dtype))
    return plan_w4a16_kernels(shapes, measured)


def _num_bytes(dtype: torch.dtype, shape: tuple) -> int:
    return torch.empty((), dtype=dtype).element_size() * int(torch.Size(shape).numel())


def _tokenizer_files(model_dir: Path) -> list[str]:
    names = [name for name in TOKENIZER_FILES if (model_dir / name).is_file()]
    if not {"tokenizer.json", "tokenizer.model", "vocab.json"} & set(names):
        raise CheckpointError(f"{model_dir}: no tokenizer files (tokenizer.json, tokenizer.model or vocab.json)")
    return names


def _copy_tokenizer(model_dir: Path, dest: Path) -> None:
    """The tokenizer files, and a sentence-transformers model's pooling settings (runtime/pooling.py)."""
    dest.mkdir(parents=True)
    for name in [*_tokenizer_files(model_dir), *sentence_transformers_files(model_dir)]:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(model_dir / name, dest / name)


def _write_weights(ctx: _Context, root: Path, show_progress: bool) -> list[int]:
    """Stream the checkpoint through the packer one layer at a time, writing each rank's shard of it
    into that rank's file; returns the bytes of each rank's file."""
    layouts = all_rank_layouts(ctx.model, ctx.parallel)
    rank_specs = [artifact_tensor_specs(ctx.model, ctx.module_formats, layout) for layout in layouts]
    paths = [root / art.rank_weights_path(layout.rank) for layout in layouts]
    writer = ShardedWriter(paths, rank_specs, metadata={"format": "pt", "llmc": llmc.__version__})
    with _reader(ctx, merge=_reading_merge(ctx), derived=ctx.derived) as reader, \
            tqdm(total=ctx.model.num_layers, desc="layers", unit="layer", disable=not show_progress) as bar:
        packer, pack_global_fn = _packers(ctx, reader)
        packer = _observe_kv(ctx, reader, packer)
        for unit in ["embed", *range(ctx.model.num_layers), *global_modules(ctx.model)[1:]]:
            for rank, tensors in _unit_shards(ctx, reader, unit, layouts, packer, pack_global_fn):
                writer.write(rank, tensors)
            reader.release()  # the shards' pages read for this unit leave the build's resident memory
            bar.update(1 if isinstance(unit, int) else 0)
        ctx.report = packer.report() if hasattr(packer, "report") else {}
        if isinstance(packer, KVScaleObserver):
            ctx.kv_scales = packer.scales()
    writer.close()
    return [path.stat().st_size for path in paths]


def _write_vision(ctx: _Context, root: Path) -> None:
    """A vision checkpoint's vision tower and projector, dense in the model dtype (compiler/vision.py)."""
    with hf.TensorReader(ctx.model_dir) as reader:
        write_vision_weights(reader, root / art.VISION_WEIGHTS, ctx.model.dtype)


def _unit_shards(ctx: _Context, reader: hf.TensorReader, unit: str | int, layouts: list[RankLayout], packer, pack_global_fn):
    """(rank, {tensor name: packed tensor}) for each rank holding `unit` (a layer index or a global module)."""
    dtype = getattr(torch, ctx.model.dtype)
    if isinstance(unit, int):
        layer = order_down_groups(packer(getattr(packer, "read_layer", read_layer)(reader, ctx.spec, ctx.model, unit)))
        for layout in (lay for lay in layouts if unit in lay.layers):
            packed = pack_layer(shard_layer(layer, layout, ctx.model, ctx.spec), ctx.module_formats, dtype,
                                float32_norms(ctx.model))
            yield layout.rank, {f"layers.{unit}.{name}": tensor for name, tensor in packed.items()}
        return
    holders = [lay for lay in layouts if (lay.has_embed if unit == "embed" else lay.has_head)]
    read = getattr(packer, "read_global", read_global)  # an import's quantized lm_head: its packed tensors
    weight = pack_global_fn(unit, read(reader, ctx.spec, unit, padded_vocab_size(ctx.model.vocab_size, ctx.parallel.tensor)))
    for layout in holders:
        yield layout.rank, pack_global(unit, shard_global(unit, weight, layout), ctx.module_formats, dtype)


def _packers(ctx: _Context, reader: hf.TensorReader):
    """(layer packer, global packer) for the recipe's method."""
    quant = ctx.recipe.quantization
    if quant.method == "none":
        return dense_packer, dense_global_packer
    if quant.method == "import" and ctx.gguf is not None:
        packer = GGUFImportPacker(ctx.spec, ctx.model, ctx.module_formats, reader)
        return packer, packer.pack_global
    if quant.method == "import":
        packer = ImportPacker(ctx.hf_config, ctx.spec, ctx.model, ctx.module_formats, reader)
        return packer, packer.pack_global
    calibration, held_out = _calibration_data(ctx)
    packer = QuantizingPacker(quant, ctx.module_formats, ctx.model, ctx.spec, reader, calibration, held_out,
                              _calibration_device())
    return packer, packer.pack_global


def _observe_kv(ctx: _Context, reader: hf.TensorReader, packer):
    """An FP8 KV cache's scales: the imported checkpoint's, or measured on the calibration windows
    (the packer wrapped in a KVScaleObserver), or none (1.0 at run time, said here in one line)."""
    kv_cache_dtype = ctx.recipe.runtime.kv_cache_dtype
    if ctx.recipe.quantization.method == "import":
        ctx.kv_scales = checkpoint_kv_scales(ctx.hf_config, reader, ctx.spec, ctx.model.num_layers)
    if kv_cache_dtype == "auto" or ctx.kv_scales is not None:
        return packer
    if ctx.recipe.quantization.calibration.data is None or ctx.recipe.quantization.method == "import":
        logger.info("runtime.kv_cache_dtype %s: no calibration data, K/V scales 1.0 (vLLM's default); set "
                    "quantization.calibration.data to measure per-layer scales", kv_cache_dtype)
        return packer
    calibration, _ = _calibration_windows(ctx, num_eval=0)
    runner = LayerRunner(ctx.model, calibration.shape[1], _calibration_device())
    embed = reader.get(ctx.spec.global_tensors["embed.weight"]).float()
    return KVScaleObserver(packer, runner, embed_windows(embed, calibration, ctx.model), fp8_max(kv_cache_dtype))


def _check_calibration_seq_len(recipe: Recipe, model: art.ModelConfig) -> None:
    """Calibration windows longer than the model's context would calibrate on positions it never saw."""
    quant = recipe.quantization
    if quant.calibration.data is None or quant.method in ("none", "import"):
        return
    if (problem := max_model_len_problem(quant.calibration.seq_len, model)) is not None:
        raise RecipeError(f"quantization.calibration.seq_len: {problem}")


def _calibration_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _calibration_windows(ctx: _Context, num_eval: int):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ctx.model_dir), local_files_only=True)
    calib = ctx.recipe.quantization.calibration
    seed = calib.seed if calib.shuffle else None
    return calibration_windows(tokenizer, calib.data, calib.num_samples, calib.seq_len, seed, num_eval,
                               vocab_size=ctx.model.vocab_size)


def _calibration_data(ctx: _Context):
    quant = ctx.recipe.quantization
    if quant.calibration.data is None:
        return None, None
    num_eval = NUM_REPORT_WINDOWS if quant.report else 0
    calibration, held_out = _calibration_windows(ctx, num_eval)
    needs_calibration = (quant.method in ("gptq", "awq") or (quant.method == "fp8" and quant.activations == "static")
                         or (quant.method == "int8" and (quant.algorithm == "gptq" or bool(quant.smoothquant))))
    return (calibration if needs_calibration else None), (held_out if num_eval else None)


def _write_onnx(ctx: _Context, root: Path) -> list[int]:
    """onnx-cpu: the packed weights become root/onnx/ (graph + external data), then go."""
    weights = root / art.rank_weights_path(0)
    max_positions = max(ctx.model.max_position_embeddings, _resolve_runtime(ctx.recipe, ctx.model).max_model_len)
    record = export_onnx(root, ctx.model, ctx.module_formats, weights, max_positions,
                         ctx.recipe.target.int4_accuracy_level or DEFAULT_INT4_ACCURACY_LEVEL)
    shutil.rmtree(weights.parent)
    ctx.target = {"device": ctx.recipe.target.device, "model_format": om.MODEL_FORMAT, "onnx": record}
    return [sum(p.stat().st_size for p in (root / om.MODEL_PATH).parent.iterdir())]


def _write_manifest(ctx: _Context, root: Path, weight_bytes: list[int]) -> art.Manifest:
    recipe = ctx.recipe
    runtime = _resolve_runtime(recipe, ctx.model)
    if ctx.target:  # per-sequence KV slots: no shared prefix blocks (runtime/onnx_model.py)
        runtime = dataclasses.replace(runtime, enable_prefix_caching=False)
    scales = ctx.kv_scales
    # an ONNX graph keeps K/V in float32 whatever the weights' dtype (onnx_export's past_key_values)
    kv_dtype = "float32" if ctx.target else art.kv_storage_dtype(runtime.kv_cache_dtype, ctx.model.dtype)
    model = ctx.model
    shape = art.latent_kv_shape(model) if model.is_mla else (len(model.kv_layers), model.num_kv_heads, model.head_dim)
    kv = art.KVSpec(runtime.block_size, kv_dtype, *shape,
                    k_scales=scales.k_scales if scales else [], v_scales=scales.v_scales if scales else [],
                    scales_source=scales.source if scales else "none", latent=model.is_mla)
    manifest = art.Manifest(
        format_version=art.FORMAT_VERSION,
        llmc_version=llmc.__version__,
        source=_source_record(ctx),
        model=ctx.model,
        quant=art.QuantInfo(method=recipe.quantization.method, modules=ctx.module_formats,
                            settings=dataclasses.asdict(recipe.quantization), report=ctx.report),
        parallel=ctx.parallel,
        kv=kv,
        plan=_plan(recipe, ctx.model, ctx.parallel, runtime, kv, weight_bytes, ctx.w4a16_kernels, root),
        runtime=runtime,
        files=art.hash_files(root),
        target=ctx.target,
        vision=ctx.vision,
        mtp=ctx.mtp,
    )
    art.write_manifest(root, manifest)
    return manifest


def _resolve_runtime(recipe: Recipe, model: art.ModelConfig) -> art.RuntimeDefaults:
    runtime = recipe.runtime
    # vLLM's default: the model's context, scaled
    max_model_len = runtime.max_model_len or model_context_of(model)[0]
    if (problem := max_model_len_problem(max_model_len, model)) is not None:
        raise RecipeError(f"runtime.max_model_len: {problem}")
    if (problem := state_dtype_problem(model, runtime)) is not None:
        raise RecipeError(f"runtime.{problem}")
    if runtime.num_kv_blocks is not None and runtime.num_kv_blocks * runtime.block_size < max_model_len:
        need = -(-max_model_len // runtime.block_size)
        raise RecipeError(
            f"runtime.num_kv_blocks: {runtime.num_kv_blocks} blocks of {runtime.block_size} tokens hold fewer than one "
            f"sequence of max_model_len {max_model_len}; raise it to at least {need}, or lower max_model_len"
        )
    generation_config = runtime.generation_config
    if generation_config not in ("auto", "vllm"):  # a folder: as the build found it, not relative to a later run's cwd
        if not (Path(generation_config) / "generation_config.json").is_file():
            logger.warning("runtime.generation_config %r: no generation_config.json there on this machine; a run "
                           "refuses to start where that folder does not hold one (use 'auto', the model's, or "
                           "'vllm')", generation_config)
        generation_config = str(Path(generation_config).absolute())
    if model.is_hybrid and runtime.enable_prefix_caching:  # (runtime/options.hybrid_options)
        logger.info("runtime.enable_prefix_caching false: %s is a hybrid model, without prefix caching (vLLM's "
                    "default for them)", model.architecture)
        runtime = dataclasses.replace(runtime, enable_prefix_caching=False)
    return dataclasses.replace(runtime, max_model_len=max_model_len, generation_config=generation_config)


def _plan(recipe: Recipe, model: art.ModelConfig, parallel: art.ParallelPlan, runtime: art.RuntimeDefaults,
          kv: art.KVSpec, weight_bytes: list[int], w4a16_kernels: dict, root: Path) -> art.Plan:
    """Graph buckets, the memory estimate of the rank with the least KV room (which bounds them all),
    and the W4A16 kernel table."""
    gpu_gib = recipe.target.gpu_memory_gib or DEFAULT_GPU_MEMORY_GIB
    layer_bytes = memory.layer_bytes_per_rank(root, model, parallel) if recipe.target.device == "cuda" else None
    on_gpu = (memory.gpu_weight_bytes(weight_bytes, layer_bytes, runtime.cpu_offload_gb)  # the recipe's offload
              if layer_bytes is not None else weight_bytes)
    estimates = memory.estimate_per_rank(model, parallel, on_gpu, kv.dtype, runtime, int(gpu_gib * memory.GIB))
    estimate = memory.least_room(estimates)
    if estimate.over_room:
        logger.warning("runtime.num_kv_blocks %d (%d KV tokens) is more than a %.3g GiB GPU has room for at these "
                       "settings (%d tokens): the engine will run out of memory there; lower num_kv_blocks, or drop it "
                       "to size the cache from gpu_memory_utilization", runtime.num_kv_blocks, estimate.num_kv_tokens,
                       gpu_gib, estimate.room_kv_tokens)
    if layer_bytes is not None and not estimate.fits:
        knobs = memory.knob_table(model, parallel, weight_bytes, layer_bytes, runtime, int(gpu_gib * memory.GIB),
                                  [0.5 * i for i in range(0, 2 + 2 * max(weight_bytes) // memory.GIB)])
        logger.warning(
            "max_model_len %d does not fit once in the KV cache of a %.3g GiB GPU; lower max_model_len or "
            "max_num_batched_tokens, raise gpu_memory_utilization, or quantize; or %s", runtime.max_model_len,
            gpu_gib, memory.fit_suggestion(knobs),
        )
    per_rank = {"num_kv_tokens_per_rank": [e.num_kv_tokens for e in estimates]} if len(estimates) > 1 else {}
    return art.Plan(
        cuda_graph_batch_sizes=memory.cuda_graph_batch_sizes(runtime.max_num_seqs),
        max_num_batched_tokens=runtime.max_num_batched_tokens,
        weight_bytes_per_rank=weight_bytes,
        memory={"target_gpu_memory_gib": gpu_gib, **estimate.to_dict(), **per_rank},
        w4a16_kernels=w4a16_kernels,
    )


def _source_record(ctx: _Context) -> dict:
    files = ctx.gguf.source_files() if ctx.gguf else [ctx.model_dir / "config.json", *hf.TensorReader(ctx.model_dir).source_files()]
    return {
        "path": str(ctx.recipe.model),
        "revision": ctx.recipe.revision,
        "sha256": {p.name: art.sha256_file(p) for p in files},
        "recipe": dataclasses.asdict(ctx.recipe),
        **({"adapters": [adapter.record() for adapter in ctx.lora.adapters]} if ctx.lora else {}),
    }
