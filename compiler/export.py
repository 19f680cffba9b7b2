"""`llmc export`: an llmc artifact as a Hugging Face checkpoint in compressed-tensors' format (vLLM reads it).

What is written (OUT/):
  config.json             the model's HF config, rebuilt from the manifest's ModelConfig (the source
                          checkpoint is not needed), with a compressed-tensors `quantization_config`
  model.safetensors       HF tensor names; fused linears split back (q/k/v, gate/up), except where the
                          family's checkpoints hold them fused (Phi-3's qkv_proj, gate_up_proj)
  tokenizer files         the artifact's tokenizer/ folder (generation_config.json with it, if there)

SmolLM3's config.json names its NoPE layers (no_rope_layers) and every layer's type (layer_types).

Mixture of experts (Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE, DeepSeek-V2 / V3): each expert's slice of the stacked
`moe.experts.gate_up` / `down` [E, ...] tensors is written as its own modules under the family's MoeSpec names (one
per expert and projection, as llm-compressor saves MoE models and the importer reads them); the routers and
Qwen2-MoE's shared expert gate stay dense, named in `ignore` (DeepSeek-V3's e_score_correction_bias written beside
its router). DeepSeek's latent attention goes out as its HF linears (q_proj or q_a_proj / q_b_proj,
kv_a_proj_with_mqa, kv_b_proj, o_proj). Granite MoE's checkpoints hold the experts fused (no Linear per expert):
refused. FP8 KV-cache scales (kv.k_scales / v_scales) go out as compressed-tensors' kv_cache_scheme with each
layer's `self_attn.k_scale` / `v_scale`, float32 [1] (compiler/kv_scales.checkpoint_kv_scales reads them back).

Weights, per linear format (the facts of compressed-tensors' layouts: quant/importers.py's docstring):
  w4a16 / w8a16  → format "pack-quantized": weight_packed int32 [out, in / (32 // bits)] (levels in
                   [0, 2**bits), = signed levels + 2**(bits-1)), weight_scale [out, G] (model dtype),
                   weight_shape int64 [2], weight_zero_point int32 [ceil(out / (32 // bits)), G] (packed
                   along the output dim) when asymmetric, weight_g_idx int32 [in] with actorder "group"
  w8a8-fp8       → format "float-quantized": weight float8_e4m3fn [out, in], weight_scale float32 [out, 1]
                   (strategy channel) or [1] (tensor), input_scale float32 [1] when activations are static
  w8a8-fp8-block → format "float-quantized", llm-compressor's FP8_BLOCK: weight float8_e4m3fn [out, in],
                   weight_scale float32 [ceil(out / rows), ceil(in / columns)] per HF module (the artifact's per-row
                   scales compacted; refused where the rows of one of a module's blocks hold different scales, as
                   a build's fused q/k/v whose sizes are not multiples of the block rows do); activations dynamic,
                   per token and `columns` inputs (strategy group)
  w8a8-int8      → format "int-quantized": weight int8 [out, in] (signed levels), weight_scale [out, 1] in the
                   model dtype (float32 where that would round it); activations int8 per token, dynamic
  dense          → `.weight` in the model dtype, the module listed in `ignore`
The levels come back from either layout of an int format (plain, or the gpu layout with its act-order
`perm` undone), so the export is exact: it moves bits, it does not re-quantize. An act-order build may
have permuted gate_up's rows and down's input columns alike (compiler/shard.order_down_groups): that is a
correct model as it stands, exported as it is.
"""

from __future__ import annotations

import itertools
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from llmc.compiler.import_quantized import tensors_by_module
from llmc.compiler.shard import take_rows
from llmc.errors import ArtifactError
from llmc.kernels.fp8 import compact_row_scales
from llmc.kernels.w4a16_gemm import unpack_w4a16_from_gpu
from llmc.quant.formats import (Fp8BlockFormat, Fp8Format, Int8W8A8Format, IntWeightFormat, QuantizedWeight,
                                default_g_idx, make_format)
from llmc.quant.importers import (pack_float_quantized, pack_fp8_block, pack_int_quantized,
                                  pack_pack_quantized)
from llmc.quant.packing import unpack_words
from llmc.runtime import artifact as art
from llmc.runtime.models import CLASSIFIER_ARCHITECTURES, spec_for_family
from llmc.runtime.models.spec import ModelSpec, hf_member_rows, in_layer, layer_norm_names

_MODEL_TYPES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3", "Olmo2ForCausalLM": "olmo2",
                "MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe", "OlmoeForCausalLM": "olmoe",
                "Qwen2MoeForCausalLM": "qwen2_moe", "DeepseekV2ForCausalLM": "deepseek_v2",
                "DeepseekV3ForCausalLM": "deepseek_v3", "SmolLM3ForCausalLM": "smollm3",
                "Ministral3ForCausalLM": "ministral3"}


@dataclass
class ExportResult:
    out_dir: Path
    format: str  # "pack-quantized" | "float-quantized" | "int-quantized" | "dense"
    quantized: list[str] = field(default_factory=list)  # HF module names
    ignored: list[str] = field(default_factory=list)  # HF module names left dense
    num_tensors: int = 0


def export_artifact(artifact_dir: str | Path, out_dir: str | Path) -> ExportResult:
    """Write ARTIFACT as a compressed-tensors checkpoint in OUT (which must not exist or be empty)."""
    artifact_dir, out_dir = Path(artifact_dir), Path(out_dir)
    manifest = art.read_manifest(artifact_dir)
    _refuse_unexpressible(artifact_dir, manifest)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ArtifactError(f"{out_dir} exists and is not an empty folder; name a new folder for the export")
    weights_rel = art.rank_weights_path(0)
    art.verify_for_load(artifact_dir, manifest, [weights_rel])
    tensors = load_file(str(artifact_dir / weights_rel))
    model = manifest.model
    spec = spec_for_family(model.family)
    dtype = getattr(torch, model.dtype)

    out_tensors: dict[str, Tensor] = {}
    schemes: dict[str, dict] = {}  # HF module → its format spec (quantized ones)
    ignored: list[str] = []
    linears = _linears(model, spec)
    by_module = {module: {param: tensors[name] for param, name in params.items()}
                 for module, params in tensors_by_module(tensors).items()}
    read = []  # (members, in_features, format, the weight read back, bias) of every linear (every expert)
    for runtime_name, expert, members, in_features in linears:
        fmt_spec = manifest.quant.modules.get(runtime_name, {"format": "dense"})
        params = dict(by_module.get(runtime_name, {}))
        if expert is not None:  # the stacked [E, ...] tensors of ExpertLinears: this expert's slice
            params = {k: v[expert] for k, v in params.items()}
        bias = params.pop("bias", None)
        fmt = make_format(fmt_spec, dtype)
        if fmt_spec["format"] == "dense":
            weight = params["weight"]
            ignored += [hf for hf, _ in members]
        elif isinstance(fmt, IntWeightFormat):
            weight = _int_weight(fmt, params, in_features)
        elif isinstance(fmt, Fp8Format):
            weight = QuantizedWeight(params["weight"], params["weight_scale"].float(), None, 8, -1,
                                     input_scale=params.get("input_scale"))
        elif isinstance(fmt, Int8W8A8Format):
            weight = QuantizedWeight(params["weight"].to(torch.int32) + 128, params["weight_scale"].float(), None, 8, -1)
        elif isinstance(fmt, Fp8BlockFormat):
            weight = QuantizedWeight(params["weight"], params["weight_scale"].float(), None, 8, fmt.group_size)
        else:  # pragma: no cover - every registered format is handled above
            raise ArtifactError(f"{runtime_name}: format {fmt_spec['format']!r} has no compressed-tensors form")
        if fmt_spec["format"] != "dense":
            schemes |= {hf: fmt_spec for hf, _ in members}
        read.append((members, in_features, fmt, weight, bias))
    act_order = any(isinstance(w, QuantizedWeight) and w.g_idx is not None for _, _, _, w, _ in read)
    for members, in_features, fmt, weight, bias in read:
        sizes = [size for _, size in members]
        rows = [(start, start + size) for start, size in zip(itertools.accumulate([0] + sizes), sizes)]
        if isinstance(weight, Tensor):
            pieces = [{"weight": w} for w in weight.split(sizes)]
        elif isinstance(fmt, IntWeightFormat):
            if act_order and weight.g_idx is None:
                weight.g_idx = default_g_idx(in_features, fmt.group_size)  # actorder "group": every module has one
            pieces = [pack_pack_quantized(take_rows(weight, [r]), scale_dtype=dtype) for r in rows]
        elif isinstance(fmt, Int8W8A8Format):
            pieces = [pack_int_quantized(take_rows(weight, [r]), scale_dtype=dtype) for r in rows]
        elif isinstance(fmt, Fp8BlockFormat):
            pieces = [pack_fp8_block(_whole_blocks(artifact_dir, hf, take_rows(weight, [r]), fmt.block_size), fmt.block_size)
                      for (hf, _), r in zip(members, rows)]
        else:
            pieces = [pack_float_quantized(take_rows(weight, [r])) for r in rows]
        biases = bias.split(sizes) if bias is not None else [None] * len(members)
        for i, ((hf, _), piece, b) in enumerate(zip(members, pieces, biases)):
            # members share their input's tensors (input_scale, weight_g_idx): each gets its own copy
            out_tensors |= {f"{hf}.{k}": v.contiguous() if i == 0 else v.clone() for k, v in piece.items()}
            if b is not None:
                out_tensors[f"{hf}.bias"] = b.clone()
    out_tensors |= _other_tensors(tensors, model, spec, {name for name, _, _, _ in linears})
    ignored += _routers(model, spec)  # Linear modules too, never quantized (as llm-compressor's ignore has them)
    if model.is_classifier:
        ignored.append("score")  # (a classifier's head: never quantized)

    scheme_keys = {json.dumps(_scheme_key(s), sort_keys=True) for s in schemes.values()}
    if len(scheme_keys) > 1:
        raise ArtifactError(f"{artifact_dir}: the artifact mixes quantization schemes ({', '.join(sorted(scheme_keys))}); "
                            "export writes one compressed-tensors scheme: build without per-module overrides")
    quant_config = _quantization_config(next(iter(schemes.values())), act_order, ignored) if schemes else None
    if manifest.kv.scales_source != "none":
        out_tensors |= _kv_scales(manifest.kv, spec)
        quant_config["kv_cache_scheme"] = KV_CACHE_SCHEME
    config = hf_config_of(model)
    if quant_config is not None:
        config["quantization_config"] = quant_config

    tmp = out_dir.with_name(out_dir.name + ".tmp-export")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        save_file(out_tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for rel in art.tokenizer_files(manifest):  # the tokenizer, chat template, generation_config.json,
            dest = tmp / Path(rel).relative_to(art.TOKENIZER_DIR)  # a sentence-transformers model's 1_Pooling/
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(artifact_dir / rel, dest)
        if out_dir.exists():
            out_dir.rmdir()
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    layout = quant_config["format"] if quant_config else "dense"
    return ExportResult(out_dir, layout, sorted(schemes), ignored, len(out_tensors))


def _refuse_unexpressible(artifact_dir: Path, manifest: art.Manifest) -> None:
    """One line per thing compressed-tensors (or this export) cannot say, naming what to do instead."""
    where = f"{artifact_dir}: cannot export"
    if manifest.target.get("model_format", "safetensors") != "safetensors" or manifest.target.get("onnx"):
        raise ArtifactError(f"{where} an ONNX artifact; build the recipe for target.device cpu or cuda and export that")
    parallel = manifest.parallel
    if parallel.world_size > 1:
        raise ArtifactError(f"{where} a parallel artifact (tensor {parallel.tensor}, pipeline {parallel.pipeline}: "
                            f"{parallel.world_size} ranks); build with parallel.tensor: 1 and parallel.pipeline: 1 "
                            "(vLLM splits the exported checkpoint itself)")
    model = manifest.model
    if model.is_hybrid:
        raise ArtifactError(f"{where} architecture {model.architecture}: a hybrid model's Gated DeltaNet, Mamba-2 "
                            "or short-conv layers are not exported; serve it with `llmc run`")
    if not model.gated_mlp:
        raise ArtifactError(f"{where} architecture {model.architecture}: its MLP without gate (hidden_act "
                            f"{model.hidden_act}: mlp.up, not mlp.gate_up) is not exported; serve it with `llmc run`")
    if model.family in ("granitemoe", "granitemoeshared"):
        raise ArtifactError(f"{where} architecture {model.architecture}: Granite MoE's checkpoints store every "
                            "expert of a layer fused (block_sparse_moe.input_linear / output_linear [E, ...]), "
                            "which compressed-tensors quantizes as no Linear, and the build folded its "
                            "residual_multiplier and logits_scaling into the weights; serve it with `llmc run`")
    if model.family in ("granite", "granitemoehybrid"):
        raise ArtifactError(f"{where} architecture {model.architecture}: the build folded Granite's residual_multiplier "
                            "and logits_scaling into the o_proj/down_proj and final norm weights, which a Granite "
                            "checkpoint would apply again; serve it with `llmc run`")
    if model.rotary_rows_permuted:
        raise ArtifactError(f"{where} architecture {model.architecture}: the build permuted q_proj's and k_proj's rows "
                            "out of its rotary layout (hf_checkpoint.rotary_fold), "
                            "which its checkpoints would read as they are; serve it with `llmc run`")
    if CLASSIFIER_ARCHITECTURES.get(model.architecture, model.architecture) not in _MODEL_TYPES:
        raise ArtifactError(f"{where} architecture {model.architecture}; export writes {', '.join(_MODEL_TYPES)} "
                            "(and their *ForSequenceClassification)")
    if model.is_partial_rotary and int(model.head_dim * partial_rotary_factor(model)) != model.rotary_dims:
        raise ArtifactError(f"{where} rotary_dim {model.rotary_dims} of head_dim {model.head_dim}: no "
                            "partial_rotary_factor gives it back as transformers reads one")
    for name, spec in manifest.quant.modules.items():
        if spec["format"] == "w3a16":
            raise ArtifactError(f"{where} {name}: 3-bit weights (w3a16) have no compressed-tensors layout vLLM "
                                "runs; build with quantization.bits: 4 or 8")
        if spec["format"] not in ("dense", "w4a16", "w8a16", "w8a8-fp8", "w8a8-fp8-block", "w8a8-int8"):
            raise ArtifactError(f"{where} {name}: format {spec['format']!r} has no compressed-tensors form")
    if manifest.kv.scales_source != "none" and model.is_mla:
        raise ArtifactError(f"{where} FP8 KV-cache scales of {model.architecture}: llmc's one latent-cache scale per "
                            "layer has no kv_cache_scheme form verified against vLLM's MLA cache; build without "
                            "runtime.kv_cache_dtype fp8")
    if manifest.kv.scales_source != "none" and all(s["format"] == "dense" for s in manifest.quant.modules.values()):
        raise ArtifactError(f"{where} FP8 KV-cache scales (kv.scales_source {manifest.kv.scales_source}) of an "
                            "unquantized model: export writes them beside a quantized scheme (a kv_cache_scheme "
                            "without config_groups does not import back); build with a quantization method, or "
                            "without runtime.kv_cache_dtype fp8 and pass --kv-cache-dtype fp8 to vLLM instead")


# compressed-tensors' kv_cache_scheme (QuantizationArgs) for FP8 K and V with one static scale per layer each, as
# llm-compressor saves it and vLLM reads it (k_scale / v_scale: the dequantization factors, amax / 448)
KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "group_size": None,
                   "strategy": "tensor", "block_structure": None, "actorder": None, "observer": "minmax",
                   "observer_kwargs": {}}


def _kv_scales(kv: art.KVSpec, spec: ModelSpec) -> dict[str, Tensor]:
    """Each layer's `self_attn.k_scale` / `v_scale` (float32 [1]), as compressed-tensors writes them. A scale is
    e4m3's (kv_cache_scheme's float 8): scales calibrated for e5m2 (amax / 57344) are given back as amax / 448."""
    made_for = kv.dtype if kv.scales_source == "calibration" and kv.dtype.startswith("float8") else "float8_e4m3fn"
    factor = torch.finfo(getattr(torch, made_for)).max / torch.finfo(torch.float8_e4m3fn).max
    out = {}
    for i, (k, v) in enumerate(zip(kv.k_scales, kv.v_scales, strict=True)):
        out[f"{spec.hf_layer_prefix}{i}.self_attn.k_scale"] = torch.tensor([k * factor], dtype=torch.float32)
        out[f"{spec.hf_layer_prefix}{i}.self_attn.v_scale"] = torch.tensor([v * factor], dtype=torch.float32)
    return out


def _whole_blocks(artifact_dir: Path, module: str, weight: QuantizedWeight, block_size: list | tuple) -> QuantizedWeight:
    """weight (one HF module's rows of a w8a8-fp8-block linear), if each of its blocks holds one scale; else refused."""
    if compact_row_scales(weight.scales, block_size[0]) is None:
        raise ArtifactError(
            f"{artifact_dir}: cannot export {module}: the rows of one of its {list(block_size)} blocks hold different "
            f"weight scales (the build quantized the fused linear in blocks from its row 0, and this module's rows do not "
            f"start on a block edge), which compressed-tensors' block layout cannot store; export a model whose q/k/v "
            f"and gate/up sizes are multiples of {block_size[0]}, or build with quantization.weights: per_channel")
    return weight


def _scheme_key(spec: dict) -> dict:
    """What a format spec stores, layout aside (plain and gpu hold the same weights)."""
    return {k: v for k, v in spec.items() if k not in ("layout", "has_g_idx")}


def _linears(model: art.ModelConfig, spec: ModelSpec) -> list[tuple[str, int | None, list[tuple[str, int]], int]]:
    """(runtime name, expert index or None, [(HF module, output rows)], in_features) for every linear, lm_head
    included (a classifier's dense `score` goes with the other tensors). An MoE layer's experts are one entry per
    expert and projection: expert e of `layers.N.moe.experts.gate_up` [E, ...] is its HF gate and up modules
    (Mixtral's w1 / w3, the others' gate_proj / up_proj), of `...down` its down module."""
    hidden = model.hidden_size
    inputs = {"attn.qkv": hidden, "attn.o": model.num_heads * model.head_dim, "mlp.gate_up": hidden,
              "mlp.down": model.intermediate_size, "moe.shared.gate_up": hidden,
              "moe.shared.down": model.shared_expert_intermediate_size}
    if model.is_mla:  # DeepSeek's attention (runtime/models/mla.py)
        inputs |= {"attn.q": hidden, "attn.q_a": hidden, "attn.q_b": model.q_lora_rank, "attn.kv_a": hidden,
                   "attn.kv_b": model.kv_lora_rank, "attn.o": model.num_heads * model.v_head_dim}
    out = []
    for i in range(model.num_layers):
        prefix = f"{spec.hf_layer_prefix}{i}."
        for linear in spec.layer_linears:
            if not in_layer(linear, model, i):  # (a dense MLP in an MoE layer, a shared expert in a dense one)
                continue
            # (Phi-3's qkv_proj and gate_up_proj are one member each: written fused, as its checkpoints hold them)
            members = [(prefix + m, rows) for m, rows in zip(linear.hf_members, hf_member_rows(linear, model))]
            out.append((f"layers.{i}.{linear.name}", None, members, inputs[linear.name]))
        if model.is_moe_layer(i):
            moe, width = spec.moe, model.moe_intermediate_size
            for e in range(model.num_experts):
                expert = prefix + moe.expert_prefix.format(e)
                members = [(expert + moe.gate, width), (expert + moe.up, width)]
                out.append((f"layers.{i}.moe.experts.gate_up", e, members, hidden))
            for e in range(model.num_experts):
                members = [(prefix + moe.expert_prefix.format(e) + moe.down, hidden)]
                out.append((f"layers.{i}.moe.experts.down", e, members, width))
    if not model.tie_word_embeddings and not model.is_classifier:
        out.append(("lm_head", None, [("lm_head", model.vocab_size)], hidden))
    return out


def _routers(model: art.ModelConfig, spec: ModelSpec) -> list[str]:
    """The HF modules of every MoE layer's router (and Qwen2-MoE's shared expert gate): dense, in `ignore`."""
    if spec.moe is None:
        return []
    gates = [spec.moe.router] + ([spec.moe.shared_gate] if model.shared_expert_gate else [])
    return [f"{spec.hf_layer_prefix}{i}.{gate}" for i in model.moe_layers for gate in gates]


def _other_tensors(tensors: dict[str, Tensor], model: art.ModelConfig, spec: ModelSpec,
                   linears: set[str]) -> dict[str, Tensor]:
    """Embedding, norms (and qk norms; MLA's q_a / kv_a norms), MoE routers (and shared expert gates, DeepSeek-V3's
    e_score_correction_bias): renamed, as they are."""
    out = {}
    for runtime, hf in spec.global_tensors.items():
        if runtime.removesuffix(".weight") not in linears and runtime in tensors:
            out[hf] = tensors[runtime]
    for i in range(model.num_layers):
        for runtime, hf in layer_norm_names(spec, model, i).items():
            out[f"{spec.hf_layer_prefix}{i}.{hf}.weight"] = tensors[f"layers.{i}.{runtime}.weight"]
    for i in model.moe_layers:
        out[f"{spec.hf_layer_prefix}{i}.{spec.moe.router}.weight"] = tensors[f"layers.{i}.moe.gate.weight"]
        if model.shared_expert_gate:
            shared_gate = tensors[f"layers.{i}.moe.shared_gate.weight"]
            out[f"{spec.hf_layer_prefix}{i}.{spec.moe.shared_gate}.weight"] = shared_gate
        if model.router_scoring == "sigmoid":
            bias = tensors[f"layers.{i}.moe.gate_bias.weight"]
            out[f"{spec.hf_layer_prefix}{i}.{spec.moe.score_bias_name}"] = bias
    return out


def _int_weight(fmt: IntWeightFormat, params: dict[str, Tensor], in_features: int) -> QuantizedWeight:
    """The levels, scales, zeros and groups of an int linear, from either layout (nothing re-quantized)."""
    g_idx = None
    if fmt.is_gpu_layout:
        levels, scales, zeros = unpack_w4a16_from_gpu(params, in_features)  # columns in perm order
        if "perm" in params:  # packed column j is input column perm[j], of group j // group_size
            perm = params["perm"].long()
            levels = torch.empty_like(levels).index_copy_(1, perm, levels)
            g_idx = torch.empty(in_features, dtype=torch.int32).index_copy_(
                0, perm, default_g_idx(in_features, fmt.group_size))
    else:
        levels = unpack_words(params["qweight"], fmt.bits, dim=1, size=in_features)
        scales = params["scales"]
        zeros = None if fmt.symmetric else unpack_words(params["qzeros"], fmt.bits, dim=1, size=scales.shape[1])
        g_idx = params.get("g_idx")
    if g_idx is not None and torch.equal(g_idx.to(torch.int32), default_g_idx(in_features, fmt.group_size)):
        g_idx = None
    return QuantizedWeight(levels.contiguous(), scales.contiguous(), zeros, fmt.bits, fmt.group_size,
                           None if g_idx is None else g_idx.to(torch.int32).contiguous())


def _quantization_config(spec: dict, act_order: bool, ignored: list[str]) -> dict:
    """compressed-tensors' QuantizationConfig (as llm-compressor saves it) for one scheme on every Linear."""
    if spec["format"] == "w8a8-int8":
        layout = "int-quantized"
        weights = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False, "group_size": None,
                   "strategy": "channel", "block_structure": None, "actorder": None, "observer": "minmax",
                   "observer_kwargs": {}}
        activations = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "group_size": None,
                       "strategy": "token", "block_structure": None, "actorder": None, "observer": None,
                       "observer_kwargs": {}}
    elif spec["format"] == "w8a8-fp8-block":  # llm-compressor's FP8_BLOCK preset
        layout = "float-quantized"
        rows, columns = spec["block_size"]
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "group_size": None,
                   "strategy": "block", "block_structure": [rows, columns], "actorder": None, "observer": "minmax",
                   "observer_kwargs": {}}
        activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "group_size": columns,
                       "strategy": "group", "block_structure": None, "actorder": None, "observer": None,
                       "observer_kwargs": {}}
    elif spec["format"] == "w8a8-fp8":
        layout = "float-quantized"
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "group_size": None,
                   "strategy": "channel" if spec["is_per_channel"] else "tensor", "block_structure": None,
                   "actorder": None, "observer": "minmax", "observer_kwargs": {}}
        static = spec["is_static_input"]
        activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not static,
                       "group_size": None, "strategy": "tensor" if static else "token", "block_structure": None,
                       "actorder": None, "observer": "minmax" if static else None, "observer_kwargs": {}}
    else:
        layout = "pack-quantized"
        is_group = spec["group_size"] != -1
        weights = {"num_bits": spec["bits"], "type": "int", "symmetric": spec["symmetric"], "dynamic": False,
                   "group_size": spec["group_size"] if is_group else None,
                   "strategy": "group" if is_group else "channel", "block_structure": None,
                   "actorder": "group" if act_order else None, "observer": "minmax", "observer_kwargs": {}}
        activations = None
    return {
        "quant_method": "compressed-tensors",
        "format": layout,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations,
                                      "output_activations": None, "format": layout}},
        "ignore": ignored,
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "global_compression_ratio": None,
    }


def partial_rotary_factor(model: art.ModelConfig) -> float:
    """The partial_rotary_factor of the artifact's rotary_dim (1.0: whole heads)."""
    return model.rotary_dims / model.head_dim


def hf_config_of(model: art.ModelConfig) -> dict:
    """The HF config.json of the artifact's model, from its ModelConfig alone (what transformers and vLLM read;
    compiler/hf_checkpoint.model_config_from_hf reads it back to the same ModelConfig)."""
    model_type = _MODEL_TYPES[CLASSIFIER_ARCHITECTURES.get(model.architecture, model.architecture)]
    eos = model.eos_token_ids
    config = {
        "architectures": [model.architecture],
        "model_type": model_type,
        "vocab_size": model.vocab_size,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.intermediate_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_heads,
        "num_key_value_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": model.rms_norm_eps,
        "rope_theta": model.rope_theta,
        "rope_scaling": model.rope_scaling,
        "max_position_embeddings": model.max_position_embeddings,
        "tie_word_embeddings": model.tie_word_embeddings,
        "attention_bias": model.attention_bias,
        "mlp_bias": False,
        "bos_token_id": model.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        # the artifact does not record one (generation_config.json keeps the model's); said so that a config
        # class default (Phi3Config's 32000) does not stand in, past the end of a smaller vocabulary
        "pad_token_id": None,
        "torch_dtype": model.dtype,
        "sliding_window": model.sliding_window,
    }
    if model.is_classifier:  # the labels, and the problem_type that gives back the activation (hf_checkpoint)
        config |= {"num_labels": model.num_labels, "id2label": dict(enumerate(model.labels)),
                   "label2id": {label: i for i, label in enumerate(model.labels)}}
        default = "sigmoid" if model.num_labels == 1 else "softmax"
        if model.classifier_activation != default:
            config["problem_type"] = {"identity": "regression", "sigmoid": "multi_label_classification"}[
                model.classifier_activation]
    if (model.rope_scaling or {}).get("rope_type") == "longrope":
        # Phi3Config's own original_max_position_embeddings (default 4096) overrides the rope parameters' one: say it
        config["original_max_position_embeddings"] = model.rope_scaling["original_max_position_embeddings"]
    if model.is_partial_rotary:  # Phi-4-mini's form: transformers rotates int(head_dim * factor) dims
        config["partial_rotary_factor"] = partial_rotary_factor(model)
    if model.is_mla:
        config |= _deepseek_config(model, model_type)
    elif model.moe_layers:
        config |= _moe_config(model, model_type)
    if model_type in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe"):
        config["use_sliding_window"] = model.sliding_window is not None
        config["max_window_layers"] = model.num_layers if model.sliding_window is None else 0
    if model.sliding_window is not None and model.sliding_window_layers is not None:
        config["layer_types"] = ["sliding_attention" if i in model.sliding_window_layers else "full_attention"
                                 for i in range(model.num_layers)]
    if model_type == "smollm3":  # its NoPE layers, and every layer's type (SmolLM3Config would derive them from those)
        config |= {"no_rope_layers": [int(model.rotates(i)) for i in range(model.num_layers)],
                   "use_sliding_window": model.sliding_window is not None,
                   "layer_types": ["sliding_attention" if model.window_of(i) else "full_attention"
                                   for i in range(model.num_layers)]}
    if model_type == "ministral3":  # its query temperature is a rope parameter (Ministral3Config's rope_parameters)
        del config["rope_theta"], config["rope_scaling"]
        config["rope_parameters"] = {"rope_theta": model.rope_theta, **model.rope_scaling,
                                     "llama_4_scaling_beta": model.query_temperature_beta}
    return config


def _moe_config(model: art.ModelConfig, model_type: str) -> dict:
    """An MoE family's config keys, as its transformers config class names them (compiler/hf_checkpoint._moe_fields
    reads them back): Mixtral and OLMoE, an MoE in every layer of width intermediate_size; Qwen3-MoE and Qwen2-MoE,
    the dense layers as mlp_only_layers (decoder_sparse_step 1), Qwen2-MoE's gated shared expert and q/k/v biases."""
    experts = {"num_experts_per_tok": model.num_experts_per_tok}
    if model_type == "mixtral":
        return experts | {"num_local_experts": model.num_experts, "intermediate_size": model.moe_intermediate_size}
    if model_type == "olmoe":
        return experts | {"num_experts": model.num_experts, "intermediate_size": model.moe_intermediate_size,
                          "norm_topk_prob": model.norm_topk_prob, "clip_qkv": None}
    config = experts | {"num_experts": model.num_experts, "moe_intermediate_size": model.moe_intermediate_size,
                        "norm_topk_prob": model.norm_topk_prob, "decoder_sparse_step": 1,
                        "mlp_only_layers": [i for i in range(model.num_layers) if not model.is_moe_layer(i)]}
    if model_type == "qwen2_moe":
        config |= {"shared_expert_intermediate_size": model.shared_expert_intermediate_size or 0,
                   "qkv_bias": model.attention_bias}
    return config


def _deepseek_config(model: art.ModelConfig, model_type: str) -> dict:
    """DeepSeek's config keys, as DeepseekV2Config / DeepseekV3Config name them (compiler/hf_checkpoint._deepseek_config
    and _deepseek_fields read them back): the latent attention's sizes (head_dim the rope part's, as transformers
    sets it), the MoE layers from first_k_dense_replace on, the shared experts as n_shared_experts of the experts'
    width, and the router (V2: greedy or group_limited_greedy; V3: noaux_tc with sigmoid scores)."""
    first_moe = model.moe_layers[0] if model.moe_layers else model.num_layers
    shared = (model.shared_expert_intermediate_size or 0) // model.moe_intermediate_size
    config = {"head_dim": model.qk_rope_head_dim, "kv_lora_rank": model.kv_lora_rank, "q_lora_rank": model.q_lora_rank,
              "qk_nope_head_dim": model.qk_nope_head_dim, "qk_rope_head_dim": model.qk_rope_head_dim,
              "v_head_dim": model.v_head_dim, "n_routed_experts": model.num_experts,
              "num_experts_per_tok": model.num_experts_per_tok, "moe_intermediate_size": model.moe_intermediate_size,
              "n_shared_experts": shared, "first_k_dense_replace": first_moe, "moe_layer_freq": 1,
              "routed_scaling_factor": model.routed_scaling_factor, "n_group": model.router_groups,
              "topk_group": model.router_topk_groups, "norm_topk_prob": model.norm_topk_prob}
    if model_type == "deepseek_v2":
        method = "group_limited_greedy" if model.router_groups else "greedy"
        return config | {"topk_method": method, "scoring_func": "softmax"}
    return config | {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "rope_interleave": model.mla_rope_interleave}
