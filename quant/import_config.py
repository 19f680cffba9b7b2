"""Reading a pre-quantized checkpoint's `quantization_config` and checking its tensors against it.

`parse_quantization_config` normalises the five published families into one `ImportSpec`:
  awq                 AutoAWQ, GEMM layout only (4 bits, zero points)
  gptq                AutoGPTQ / GPTQModel, checkpoint_format "gptq" (v1: zeros stored minus 1) or "gptq_v2"
  compressed-tensors  llm-compressor, `pack-quantized` (int weights), `float-quantized` (FP8 W8A8: per channel,
                      per tensor, or FP8_BLOCK's 128 x 128 blocks) or `int-quantized` (W8A8 int8)
  fp8                 transformers' FineGrainedFP8Config / DeepSeek-V3 / Qwen3 FP8 (`weight_block_size`: weight and
                      weight_scale_inv per block), or without blocks vLLM's per-tensor FP8 (weight_scale, input_scale)
  modelopt            NVIDIA TensorRT Model Optimizer's FP8 (`quant_algo` FP8: per-tensor weight and static input
                      scales; FP8_PER_CHANNEL_PER_TOKEN: per-channel weight scales, dynamic per-token activations)
Anything else raises a CheckpointError naming what is supported.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import re
from dataclasses import dataclass
from typing import Mapping

import torch
from torch import Tensor

from llmc.errors import CheckpointError
from llmc.quant.formats import INT_FORMAT_NAMES, SUPPORTED_GROUP_SIZES, is_fp8_block_size
from llmc.quant.packing import levels_per_word

SUPPORTED = (
    "awq (version gemm), gptq (checkpoint_format gptq or gptq_v2), "
    "compressed-tensors (pack-quantized int weights, float-quantized fp8 w8a8 per channel, per tensor or in blocks, "
    "int-quantized int8 w8a8), fp8 (transformers' / DeepSeek-V3's / Qwen3's weight_block_size, or vLLM's per tensor), "
    "modelopt (quant_algo FP8 or FP8_PER_CHANNEL_PER_TOKEN)"
)


@dataclass(frozen=True)
class ImportSpec:
    """A checkpoint's quantization, normalised. Field meanings do not depend on the method."""

    method: str  # "awq" | "gptq" | "compressed-tensors" | "fp8" | "modelopt"
    layout: str  # "awq-gemm" | "gptq-v1" | "gptq-v2" | "pack-quantized" | "float-quantized" | "int-quantized" | "fp8"
    bits: int  # 8 for fp8
    group_size: int  # -1 = per output channel
    is_symmetric: bool
    is_act_order: bool  # tensors carry a g_idx whose groups may be non-contiguous
    ignored_modules: tuple[str, ...] = ()  # names (match whole dotted segments) or "re:<regex>"
    # compressed-tensors config_groups targets: "Linear" (every linear), module names or "re:<regex>";
    # a linear no target matches was left unquantized. Empty: every linear not ignored is quantized.
    targets: tuple[str, ...] = ()
    is_per_channel: bool = True  # fp8: weight scales per output channel, else per tensor
    is_static_input: bool = False  # fp8: calibrated input_scale tensors instead of per-token scales
    # fp8 in blocks (w8a8-fp8-block): (rows, columns) of one weight scale; activations per token and `columns` inputs
    block_size: tuple[int, int] | None = None

    @property
    def is_fp8(self) -> bool:
        return self.layout in ("float-quantized", "fp8")

    @property
    def scale_name(self) -> str:
        """The weight scale's tensor name: transformers' block FP8 calls its dequantization factor weight_scale_inv."""
        return "weight_scale_inv" if self.layout == "fp8" and self.block_size else "weight_scale"

    @property
    def is_int8_w8a8(self) -> bool:
        return self.layout == "int-quantized"

    def is_ignored(self, module_name: str) -> bool:
        """True if the checkpoint left this linear unquantized (its tensors are dense)."""
        for pattern in self.ignored_modules:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module_name):
                    return True
            elif self.method == "fp8":
                if _matches_fp8_skip(pattern, module_name):
                    return True
            elif self.method == "modelopt":
                if _matches_modelopt_exclude(pattern, module_name):
                    return True
            elif self.method == "compressed-tensors":
                # compressed-tensors' match_name: a plain entry is a whole module name (a parent's name, say
                # "model.layers.0.mlp", matches no Linear, so its linears stay quantized)
                if pattern == module_name:
                    return True
            elif f".{pattern}." in f".{module_name}.":
                return True
        return bool(self.targets) and not any(_is_target(t, module_name) for t in self.targets)

    def format_spec(self) -> dict:
        """The llmc format the imported weights pack into (FP8 always per channel: a per-tensor scale
        expands losslessly, and fused q/k/v with different per-tensor scales need per-channel)."""
        if self.is_fp8 and self.block_size:
            return {"format": "w8a8-fp8-block", "block_size": list(self.block_size)}
        if self.is_fp8:
            return {"format": "w8a8-fp8", "is_per_channel": True, "is_static_input": self.is_static_input}
        if self.is_int8_w8a8:
            return {"format": "w8a8-int8"}
        return {
            "format": INT_FORMAT_NAMES[self.bits],
            "bits": self.bits,
            "group_size": self.group_size,
            "symmetric": self.is_symmetric,
            "has_g_idx": self.is_act_order,
        }

    def num_groups(self, in_features: int) -> int:
        """Scale groups along a module's input (a last partial group counts)."""
        return 1 if self.group_size == -1 else -(-in_features // self.group_size)

    def required_tensor_names(self) -> tuple[str, ...]:
        """Tensor names (after the module's prefix) each quantized module must have."""
        if self.layout == "awq-gemm":
            return ("qweight", "qzeros", "scales")
        if self.layout in ("gptq-v1", "gptq-v2"):  # desc_act: the permuted groups are in g_idx
            return ("qweight", "qzeros", "scales") + (("g_idx",) if self.is_act_order else ())
        if self.layout == "pack-quantized":
            names = ("weight_packed", "weight_scale", "weight_shape")
            names += () if self.is_symmetric else ("weight_zero_point",)
            return names + (("weight_g_idx",) if self.is_act_order else ())
        if self.layout == "int-quantized":
            return ("weight", "weight_scale")
        return ("weight", self.scale_name) + (("input_scale",) if self.is_static_input else ())

    def optional_tensor_names(self) -> tuple[str, ...]:
        if self.layout == "int-quantized":  # compressed-tensors versions that save symmetric zero points (all 0)
            return ("weight_zero_point",)
        return ("g_idx",) if self.layout in ("gptq-v1", "gptq-v2") else ()


def _matches_fp8_skip(pattern: str, module_name: str) -> bool:
    """transformers' rule for modules_to_not_convert (quantizers_utils.should_convert_module): the pattern from the
    start up to a module boundary ("model.layers.1" skips "model.layers.1.mlp.down_proj", not layers.11), as a
    regex with the same boundary, or as a suffix ("down_proj")."""
    return bool(re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", module_name)) or module_name.endswith(pattern)


def _matches_modelopt_exclude(pattern: str, module_name: str) -> bool:
    """ModelOpt's exclude_modules entries are fnmatch wildcards ("lm_head", "*.mlp.gate", "model.layers.0.mlp*"). As
    vLLM reads them: "path*" (a `*` not after a dot) is the module `path` and its subtree, so "model.layers.1*" is not
    layer 11; an entry without wildcards also matches as whole dotted segments of the name ("lm_head", "mlp.gate"),
    where vLLM takes any substring ("model.layers.1" in layer 11's names): ImportPacker refuses a linear read dense
    that holds levels, and unpack_module one read quantized that lacks its scales, so no reading goes unnoticed."""
    if len(pattern) >= 2 and pattern[-1] == "*" and pattern[-2] != ".":
        return fnmatch.fnmatchcase(module_name, pattern[:-1]) or fnmatch.fnmatchcase(module_name, pattern[:-1] + ".*")
    if fnmatch.fnmatchcase(module_name, pattern):
        return True
    return not any(c in pattern for c in "*?[") and f".{pattern}." in f".{module_name}."


def _is_target(target: str, module_name: str) -> bool:
    if target == "Linear":
        return True
    return bool(re.match(target[3:], module_name)) if target.startswith("re:") else target == module_name


def _checked(method: str, bits: int, group_size: int) -> tuple[int, int]:
    for name, value in (("bits", bits), ("group_size", group_size)):
        if type(value) is not int:  # 4.0 or "4" would pass the membership tests below, then fail in unpacking
            raise CheckpointError(f"{method} quantization_config {name} is {value!r} ({type(value).__name__}); "
                                  "the checkpoint's config.json must give it as an integer")
    if bits not in INT_FORMAT_NAMES:
        raise CheckpointError(f"{method} checkpoint has {bits}-bit weights; llmc imports 3, 4 or 8 bits")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise CheckpointError(
            f"{method} checkpoint has group_size {group_size}; llmc imports {SUPPORTED_GROUP_SIZES}"
        )
    return bits, group_size


def _parse_awq(qc: dict) -> ImportSpec:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise CheckpointError(
            f"AWQ version {version!r} is not supported; re-export the checkpoint as AWQ GEMM"
        )
    if not qc.get("zero_point", True):
        raise CheckpointError(
            "AWQ without zero points is not supported; use an AWQ GEMM checkpoint with zero_point"
        )
    bits, group_size = _checked(
        "AWQ", qc.get("bits", qc.get("w_bit", 4)), qc.get("group_size", qc.get("q_group_size", 128))
    )
    if bits != 4:
        raise CheckpointError(f"AWQ GEMM checkpoints hold 4-bit weights, this one says {bits}")
    ignored = tuple(qc.get("modules_to_not_convert") or ()) + ("lm_head",)
    return ImportSpec(
        method="awq",
        layout="awq-gemm",
        bits=bits,
        group_size=group_size,
        is_symmetric=False,
        is_act_order=False,
        ignored_modules=ignored,
    )


def _parse_gptq(qc: dict) -> ImportSpec:
    checkpoint_format = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    layouts = {"gptq": "gptq-v1", "gptq_v2": "gptq-v2"}
    if checkpoint_format not in layouts:
        raise CheckpointError(
            f"GPTQ checkpoint_format {checkpoint_format!r} is not supported; use gptq or gptq_v2"
        )
    if qc.get("dynamic"):
        raise CheckpointError("GPTQ checkpoints with per-module `dynamic` overrides are not supported")
    pack_dtype = str(qc.get("pack_dtype") or "int32").removeprefix("torch.")
    if pack_dtype != "int32":  # GPTQModel's option; AutoGPTQ, vLLM's gptq kernels and llmc read int32 words
        raise CheckpointError(f"GPTQ pack_dtype {qc['pack_dtype']!r} is not supported: llmc reads qweight and qzeros "
                              "packed in int32 words (GPTQModel's default); re-export with pack_dtype int32")
    bits, group_size = _checked("GPTQ", qc.get("bits", 4), qc.get("group_size", 128))
    flags = {name: qc.get(name, default) for name, default in (("sym", True), ("desc_act", False), ("lm_head", False))}
    for name, value in flags.items():
        if not isinstance(value, bool):  # bool("false") is True
            raise CheckpointError(f"GPTQ quantization_config {name} is {value!r}; config.json must give it as true or false")
    # lm_head: true (GPTQModel, AutoGPTQ) packs lm_head like every other linear (qweight, qzeros, scales, g_idx)
    ignored = tuple(qc.get("modules_to_not_convert") or ()) + (() if flags["lm_head"] else ("lm_head",))
    return ImportSpec(
        method="gptq",
        layout=layouts[checkpoint_format],
        bits=bits,
        group_size=group_size,
        is_symmetric=flags["sym"],
        is_act_order=flags["desc_act"],
        ignored_modules=ignored,
    )


# QuantizationArgs fields that do not change what is stored (how the scales were searched, dtypes the
# loader infers from the tensors): groups that differ only in them import as one scheme.
_CALIBRATION_ONLY = ("observer", "observer_kwargs", "scale_dtype", "zp_dtype")


def _storage_fields(args: dict | None) -> dict | None:
    if not args:
        return None
    defaults = {"type": "int", "symmetric": True, "dynamic": False, "group_size": None, "block_structure": None}
    fields = defaults | {k: v for k, v in args.items() if k not in _CALIBRATION_ONLY}
    # actorder "weight"/"static"/null store no g_idx (groups stay contiguous); "group"/"dynamic" store one
    fields["actorder"] = args.get("actorder") in ("group", "dynamic", True)
    return fields


def _single_scheme(qc: dict) -> dict:
    schemes = list((qc.get("config_groups") or {}).values())
    if not schemes:
        raise CheckpointError(
            "compressed-tensors config has no config_groups; the checkpoint is not quantized"
        )
    first = schemes[0]
    for s in schemes[1:]:
        for part in ("weights", "input_activations"):
            a, b = _storage_fields(first.get(part)), _storage_fields(s.get(part))
            if a != b:
                diff = sorted(k for k in set(a or {}) | set(b or {}) if (a or {}).get(k) != (b or {}).get(k))
                raise CheckpointError(
                    f"compressed-tensors config_groups with different schemes are not supported ({part} "
                    f"differ in {', '.join(diff) or 'presence'}); use one scheme")
        if (s.get("format") or None) != (first.get("format") or None):
            raise CheckpointError("compressed-tensors config_groups with different formats "
                                  f"({first.get('format')!r}, {s.get('format')!r}) are not supported; use one scheme")
    sparsity = (qc.get("sparsity_config") or {}).get("format", "dense")
    if sparsity != "dense":
        raise CheckpointError(f"compressed-tensors sparsity_config format {sparsity!r} is not supported (sparse "
                              "checkpoints); llmc imports dense ones")
    if qc.get("transform_config"):
        # QuIP / SpinQuant-style rotations: the stored weights only mean something with the online
        # transforms (location input/output) applied at run time, which llmc does not do.
        raise CheckpointError("compressed-tensors transform_config (Hadamard/rotation transforms) is not supported: "
                              "its weights need online transforms at run time; re-export without transforms")
    for name, group in (qc.get("config_groups") or {}).items():
        if group.get("output_activations"):
            raise CheckpointError(f"compressed-tensors config_groups.{name}.output_activations "
                                  f"{group['output_activations']} (output quantization) is not supported")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise CheckpointError(f"compressed-tensors quantization_status {status!r}: save the model compressed")
    return schemes[0]


def _parse_fp8_scheme(weights: dict, activations: dict | None, ignored: tuple[str, ...]) -> ImportSpec:
    if (
        weights.get("type") != "float"
        or weights.get("num_bits") != 8
        or weights.get("strategy") not in ("channel", "tensor", "block")
    ):
        what = ", ".join(f"{k} {weights.get(k)!r}" for k in ("type", "num_bits", "strategy", "block_structure")
                         if weights.get(k) is not None)
        raise CheckpointError(f"float-quantized weights with {what} are not supported; llmc imports fp8 (float, 8 bits) "
                              "weights with strategy channel, tensor or block")
    if not activations or activations.get("type") != "float" or activations.get("num_bits") != 8:
        raise CheckpointError(
            "fp8 weight-only checkpoints are not supported; llmc imports fp8 W8A8 (FP8, FP8_DYNAMIC or FP8_BLOCK)"
        )
    if weights["strategy"] == "block":
        return _parse_fp8_block_scheme(weights, activations, ignored)
    # A dynamic per-tensor activation scheme runs per token here: finer, and the weights are unchanged.
    is_static_input = not activations.get("dynamic", False)
    return ImportSpec(
        method="compressed-tensors",
        layout="float-quantized",
        bits=8,
        group_size=-1,
        is_symmetric=True,
        is_act_order=False,
        ignored_modules=ignored,
        is_per_channel=weights["strategy"] == "channel",
        is_static_input=is_static_input,
    )


def _parse_fp8_block_scheme(weights: dict, activations: dict, ignored: tuple[str, ...]) -> ImportSpec:
    """llm-compressor's FP8_BLOCK: weights in blocks of block_structure [rows, columns], activations dynamic per token
    and `columns` inputs (strategy group, group_size = columns): what w8a8-fp8-block computes; others refused."""
    block = _checked_block("compressed-tensors float-quantized weights.block_structure", weights.get("block_structure"))
    want = {"strategy": "group", "group_size": block[1], "dynamic": True}
    if bad := [f"{k} {activations.get(k)!r}" for k, v in want.items() if activations.get(k) != v]:
        raise CheckpointError(f"float-quantized block weights {list(block)} with input_activations {', '.join(bad)} are "
                              f"not supported; llmc imports FP8_BLOCK: activations strategy group, group_size {block[1]} "
                              "(the block's columns), dynamic true")
    return ImportSpec(method="compressed-tensors", layout="float-quantized", bits=8, group_size=-1, is_symmetric=True,
                      is_act_order=False, ignored_modules=ignored, block_size=block)


def _checked_block(what: str, block) -> tuple[int, int]:
    """[rows, columns] (or compressed-tensors' older "RxC" string) → (rows, columns), as w8a8-fp8-block holds them
    (quant/formats.is_fp8_block_size)."""
    if isinstance(block, str) and re.fullmatch(r"\d+x\d+", block):
        block = [int(b) for b in block.split("x")]
    if not is_fp8_block_size(block):
        raise CheckpointError(f"{what} {block!r} is not supported; llmc imports blocks of [rows, columns], each a power "
                              "of two >= 16 (DeepSeek-V3, Qwen3 and FP8_BLOCK use [128, 128])")
    return tuple(block)


# quant_method "fp8" fields that change the numbers in ways llmc does not compute: (field, values llmc reads, why);
# fmt float8_e4m3fn: MiniMax-M2's config.json names E4M3 by its torch dtype
_FP8_REFUSED = (
    ("fmt", ("e4m3", "float8_e4m3fn"), "llmc imports E4M3 weights (float8_e4m3fn)"),
    ("scale_fmt", ("float",), "ue8m0 scales are powers of two (E8M0 bytes), and the activation scales are rounded to "
                           "powers of two at run time, which llmc does not do"),
    ("expert_dtype", ("fp8",), "llmc imports FP8 experts, not FP4-packed ones"),
)


def _parse_fp8(qc: dict) -> ImportSpec:
    """transformers' FineGrainedFP8Config (DeepSeek-V3, Qwen3-*-FP8): weight_block_size [rows, columns], weight and
    weight_scale_inv (the dequantization factor, absmax / 448, of each block) per linear, activations dynamic per
    token and `columns` inputs. Without weight_block_size: vLLM's per-tensor FP8 (weight_scale per linear,
    input_scale when activation_scheme is static), imported as w8a8-fp8. lm_head stays dense (transformers skips
    the output embeddings; vLLM never quantizes its head)."""
    for name, values, why in _FP8_REFUSED:
        if qc.get(name) not in (None, *values):
            raise CheckpointError(f"fp8 quantization_config {name} {qc[name]!r} is not supported: {why}")
    if qc.get("modules_to_convert"):
        raise CheckpointError(f"fp8 quantization_config modules_to_convert {qc['modules_to_convert']!r} (FP8 embeddings) "
                              "is not supported; llmc reads embeddings dense")
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme not in ("dynamic", "static"):
        raise CheckpointError(f"fp8 quantization_config activation_scheme {qc['activation_scheme']!r} is not supported; "
                              "llmc imports dynamic or static")
    skip = qc.get("modules_to_not_convert")
    skip = qc.get("ignored_layers") if skip is None else skip
    ignored = tuple(skip or ()) + ("lm_head",)
    block = qc.get("weight_block_size")
    if block is None:
        return ImportSpec(method="fp8", layout="fp8", bits=8, group_size=-1, is_symmetric=True, is_act_order=False,
                          ignored_modules=ignored, is_per_channel=False, is_static_input=scheme == "static")
    block = _checked_block("fp8 quantization_config weight_block_size", block)
    if scheme == "static":
        raise CheckpointError("fp8 quantization_config activation_scheme 'static' with weight_block_size is not "
                              "supported: llmc quantizes block FP8 activations per token and "
                              f"{block[1]} inputs at run time (activation_scheme dynamic)")
    return ImportSpec(method="fp8", layout="fp8", bits=8, group_size=-1, is_symmetric=True, is_act_order=False,
                      ignored_modules=ignored, block_size=block)


# ModelOpt quant_algo values llmc does not import, with what they are (the refusal names them)
_MODELOPT_REFUSED = {
    "FP8_PB_WO": "block-scaled FP8 weights, weight only",
    "FP8_PB_REAL": "block-scaled FP8 weights",
    "NVFP4": "4-bit float (NVFP4) weights and activations; vLLM's modelopt_fp4",
    "NVFP4_AWQ": "4-bit float (NVFP4) weights with AWQ pre-quant scales",
    "W4A16_NVFP4": "4-bit float (NVFP4) weights",
    "W4A8_NVFP4_FP8": "4-bit float weights with FP8 activations",
    "MXFP8": "MXFP8 (E8M0 block scales)",
    "MXFP4": "MXFP4 weights",
    "W4A8_MXFP4_FP8": "MXFP4 weights with FP8 activations",
    "INT4_AWQ": "int4 AWQ weights with pre-quant scales",
    "W4A8_AWQ": "int4 AWQ weights with FP8 activations",
    "INT8_SQ": "int8 SmoothQuant with static per-tensor activations",
    "MIXED_PRECISION": "a different quant_algo per layer (quantized_layers)",
}
MODELOPT_ALGOS = ("FP8", "FP8_PER_CHANNEL_PER_TOKEN")


def modelopt_fields(qc: dict) -> tuple[str, str | None, tuple[str, ...]]:
    """A ModelOpt config's (quant_algo, kv_cache_quant_algo, exclude_modules), upper-cased as vLLM reads them, from
    either form: hf_quant_config.json's `quantization` section (kv_cache_quant_algo, exclude_modules), or the flat
    config.json quantization_config (quant_algo, kv_cache_scheme {type float, num_bits 8} = FP8, ignore)."""
    section = qc.get("quantization")
    if isinstance(section, dict):
        algo, kv_algo = section.get("quant_algo"), section.get("kv_cache_quant_algo")
        exclude = section.get("exclude_modules")
    else:
        algo, exclude = qc.get("quant_algo"), qc.get("ignore", qc.get("exclude_modules"))
        kv_algo, scheme = qc.get("kv_cache_quant_algo"), qc.get("kv_cache_scheme")
        if scheme is not None:
            if not isinstance(scheme, dict) or scheme.get("type") != "float" or scheme.get("num_bits") != 8:
                raise CheckpointError(f"ModelOpt kv_cache_scheme {scheme!r} is not supported; llmc imports FP8 KV "
                                      "scales (type float, num_bits 8)")
            kv_algo = "FP8"
    if not isinstance(exclude or [], list) or not all(isinstance(e, str) for e in exclude or []):
        raise CheckpointError(f"ModelOpt exclude_modules {exclude!r} is not a list of module names or wildcards")
    if kv_algo is not None and not isinstance(kv_algo, str):
        raise CheckpointError(f"ModelOpt kv_cache_quant_algo {kv_algo!r} is not a string (FP8 or null)")
    return str(algo or "").upper(), kv_algo.upper() if kv_algo else None, tuple(exclude or ())


def _parse_modelopt(qc: dict) -> ImportSpec:
    """NVIDIA TensorRT Model Optimizer's FP8 export, as vLLM's `modelopt` reads it. FP8: weight float8_e4m3fn, a
    scalar weight_scale and a scalar input_scale (static activations) per linear: w8a8-fp8 with static input scales.
    FP8_PER_CHANNEL_PER_TOKEN: weight_scale [out], no input_scale: w8a8-fp8 per channel, per-token activations.
    exclude_modules (wildcards) stay dense; every other quant_algo, and KV caches other than FP8, refused by name."""
    algo, kv_algo, exclude = modelopt_fields(qc)
    if algo not in MODELOPT_ALGOS:
        what = f" ({_MODELOPT_REFUSED[algo]})" if algo in _MODELOPT_REFUSED else ""
        raise CheckpointError(f"ModelOpt quant_algo {algo or None!r}{what} is not supported; llmc imports ModelOpt "
                              "FP8 (per-tensor weights, static input scales) and FP8_PER_CHANNEL_PER_TOKEN")
    if kv_algo not in (None, "FP8"):
        raise CheckpointError(f"ModelOpt kv_cache_quant_algo {kv_algo!r} is not supported; llmc imports FP8 KV cache "
                              "scales (k_scale, v_scale) or none")
    is_per_channel = algo == "FP8_PER_CHANNEL_PER_TOKEN"
    return ImportSpec(method="modelopt", layout="float-quantized", bits=8, group_size=-1, is_symmetric=True,
                      is_act_order=False, ignored_modules=exclude, is_per_channel=is_per_channel,
                      is_static_input=not is_per_channel)


def _parse_int8_w8a8_scheme(weights: dict, activations: dict | None, ignored: tuple[str, ...]) -> ImportSpec:
    """llm-compressor's W8A8 int8 (`int-quantized`): int8 symmetric per-channel weights, int8 symmetric per-token
    dynamic activations; anything else of that format is refused by name."""
    want_weights = {"type": "int", "num_bits": 8, "symmetric": True, "strategy": "channel"}
    if bad := [f"{k} {weights.get(k)!r}" for k, v in want_weights.items() if weights.get(k, v if k == "symmetric" else None) != v]:
        raise CheckpointError(f"int-quantized weights with {', '.join(bad)} are not supported; llmc imports int8 "
                              "weights, symmetric, strategy channel (llm-compressor's W8A8)")
    if not activations:
        raise CheckpointError("int-quantized weights without quantized activations (int8 weight-only) are not "
                              "supported; llmc imports int-quantized W8A8 (int8 activations per token, dynamic)")
    want_acts = {"type": "int", "num_bits": 8, "symmetric": True, "strategy": "token", "dynamic": True}
    if bad := [f"{k} {activations.get(k)!r}" for k, v in want_acts.items()
               if activations.get(k, v if k == "symmetric" else None) != v]:
        raise CheckpointError(f"int-quantized input_activations with {', '.join(bad)} are not supported; llmc imports "
                              "int8 activations, symmetric, strategy token, dynamic true (llm-compressor's W8A8)")
    return ImportSpec(method="compressed-tensors", layout="int-quantized", bits=8, group_size=-1, is_symmetric=True,
                      is_act_order=False, ignored_modules=ignored)


def _parse_compressed_tensors(qc: dict) -> ImportSpec:
    return dataclasses.replace(_parse_compressed_scheme(qc), targets=_targets(qc))


def _targets(qc: dict) -> tuple[str, ...]:
    """Every config group's targets; () (every linear) when one of them is "Linear" or names none."""
    targets = tuple(dict.fromkeys(t for group in qc["config_groups"].values() for t in group.get("targets") or ["Linear"]))
    return () if "Linear" in targets else targets


def _parse_compressed_scheme(qc: dict) -> ImportSpec:
    scheme = _single_scheme(qc)
    weights, activations = scheme.get("weights") or {}, scheme.get("input_activations")
    layout = scheme.get("format") or qc.get("format")
    ignored = tuple(qc.get("ignore") or ())
    if layout == "float-quantized":
        return _parse_fp8_scheme(weights, activations, ignored)
    if layout == "int-quantized":
        return _parse_int8_w8a8_scheme(weights, activations, ignored)
    if layout != "pack-quantized":
        raise CheckpointError(
            f"compressed-tensors format {layout!r} is not supported; supported: {SUPPORTED}"
        )
    if activations:
        raise CheckpointError(
            "pack-quantized int weights with quantized activations (W4A8) are not supported; llmc imports W4A16/W8A16 "
            "pack-quantized and W8A8 int8 as int-quantized"
        )
    if weights.get("type") != "int" or weights.get("strategy") not in ("group", "channel"):
        raise CheckpointError(
            f"pack-quantized weights with type {weights.get('type')!r}, strategy {weights.get('strategy')!r} are not "
            "supported; llmc imports int weights with group or channel strategy"
        )
    group_size = weights.get("group_size") if weights["strategy"] == "group" else -1
    bits, group_size = _checked("compressed-tensors", weights.get("num_bits"), group_size)
    symmetric = weights.get("symmetric", True)
    if not isinstance(symmetric, bool):  # bool("false") is True
        raise CheckpointError(f"compressed-tensors weights.symmetric is {symmetric!r}; config.json must give it as "
                              "true or false")
    # actorder "group" (alias "dynamic") stores weight_g_idx; "weight"/"static" keeps groups contiguous
    return ImportSpec(
        method="compressed-tensors",
        layout="pack-quantized",
        bits=bits,
        group_size=group_size,
        is_symmetric=symmetric,
        is_act_order=weights.get("actorder") in ("group", "dynamic"),
        ignored_modules=ignored,
    )


def parse_quantization_config(config_json: dict) -> ImportSpec:
    """A checkpoint's config.json (or its `quantization_config` alone) → ImportSpec."""
    qc = config_json.get("quantization_config", config_json)
    parsers = {"awq": _parse_awq, "gptq": _parse_gptq, "compressed-tensors": _parse_compressed_tensors, "fp8": _parse_fp8,
               "modelopt": _parse_modelopt}
    method = str(qc.get("quant_method", "")).lower()
    method = "modelopt" if method.startswith("modelopt") else method  # (modelopt_fp4, modelopt_mxfp8: vLLM's names)
    if method not in parsers:
        raise CheckpointError(
            f"quantization method {method or 'none'!r} is not supported; supported: {SUPPORTED}"
        )
    return parsers[method](qc)


def expected_shapes(spec: ImportSpec, in_features: int, out_features: int) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor a module of this size has in the checkpoint's layout."""
    num_groups = spec.num_groups(in_features)
    per_word = levels_per_word(spec.bits)
    if spec.layout == "awq-gemm":
        return {
            "qweight": (in_features, out_features // 8),
            "qzeros": (num_groups, out_features // 8),
            "scales": (num_groups, out_features),
        }
    if spec.layout in ("gptq-v1", "gptq-v2"):  # bit stream: in * bits / 32 words
        return {
            "qweight": (in_features * spec.bits // 32, out_features),
            "qzeros": (num_groups, out_features * spec.bits // 32),
            "scales": (num_groups, out_features),
            "g_idx": (in_features,),
        }
    if spec.layout == "pack-quantized":
        return {
            "weight_packed": (out_features, -(-in_features // per_word)),
            "weight_scale": (out_features, num_groups),
            "weight_shape": (2,),
            "weight_zero_point": (-(-out_features // per_word), num_groups),
            "weight_g_idx": (in_features,),
        }
    if spec.layout == "int-quantized":
        return {"weight": (out_features, in_features), "weight_scale": (out_features,),
                "weight_zero_point": (out_features,)}
    if spec.block_size:
        rows, columns = spec.block_size
        return {"weight": (out_features, in_features),
                spec.scale_name: (-(-out_features // rows), -(-in_features // columns))}
    return {
        "weight": (out_features, in_features),
        "weight_scale": (out_features if spec.is_per_channel else 1,),
        "input_scale": (1,),
    }


# tensors a ModelOpt module may hold beside its format's: a bias (read with the layer), the KV cache scales
# (k_proj.k_scale, v_proj.v_scale: compiler/kv_scales.py)
_MODELOPT_OTHER_TENSORS = {"bias", "k_scale", "v_scale"}


def _is_scale(name: str) -> bool:
    return name in ("weight_scale", "input_scale")


_PACKED_INT32 = ("qweight", "qzeros", "weight_packed")
_INTEGER = ("g_idx", "weight_g_idx", "weight_shape", "weight_zero_point")
_FLOAT = ("scales", "weight_scale", "weight_scale_inv", "input_scale")


def _check_dtypes(spec: ImportSpec, module_name: str, tensors: Mapping[str, Tensor]) -> None:
    """Packed words are int32 in every published layout; a float or int64 tensor of the right shape would
    otherwise unpack into garbage levels without a word."""
    for name, tensor in tensors.items():
        dtype = tensor.dtype
        bad = (
            (name in _PACKED_INT32 and dtype != torch.int32)
            or (name in _INTEGER and (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool))
            or (name in _FLOAT and not dtype.is_floating_point)
        )
        if bad:
            want = "int32" if name in _PACKED_INT32 else "an integer dtype" if name in _INTEGER else "a float dtype"
            raise CheckpointError(f"{module_name}.{name} has dtype {dtype}, expected {want} for {spec.method} "
                                  f"({spec.layout}): the checkpoint is damaged or not in this layout")


# transformers' per-tensor FP8 (FineGrainedFP8Config with weight_block_size null) names vLLM's tensors so
_TRANSFORMERS_PER_TENSOR_NAMES = {"weight_scale_inv": "weight_scale", "activation_scale": "input_scale"}


def canonical_tensor_names(spec: ImportSpec, tensors: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    """A per-tensor quant_method fp8 module's tensors under vLLM's names (weight_scale, input_scale) when the
    checkpoint uses transformers' (weight_scale_inv, activation_scale: the same numbers); others as they are."""
    if spec.layout != "fp8" or spec.block_size or not any(n in tensors for n in _TRANSFORMERS_PER_TENSOR_NAMES):
        return tensors
    renamed = {}
    for name, tensor in tensors.items():
        vllm_name = _TRANSFORMERS_PER_TENSOR_NAMES.get(name, name)
        renamed[name if vllm_name in tensors else vllm_name] = tensor  # (both names given: each kept as it is)
    return renamed


def check_module_tensors(
    spec: ImportSpec, module_name: str, tensors: Mapping[str, Tensor], in_features: int, out_features: int
) -> None:
    """Raise a one-line CheckpointError if a module's tensors do not fit the config and the model's sizes."""
    tensors = canonical_tensor_names(spec, tensors)
    config = (f"{spec.method} fp8 blocks {list(spec.block_size)}" if spec.block_size
              else f"{spec.method} {spec.bits}-bit group_size {spec.group_size} ({spec.layout})")
    missing = [n for n in spec.required_tensor_names() if n not in tensors]
    if missing:
        raise CheckpointError(
            f"{module_name} lacks {missing} expected for {config}; is quantization_config right?"
        )
    if spec.layout in ("awq-gemm", "gptq-v1", "gptq-v2") and out_features * spec.bits % 32:
        # (pack-quantized packs its zero points along the output too, but pads the last word)
        per_word = 32 // math.gcd(32, spec.bits)
        raise CheckpointError(
            f"{module_name}: out_features {out_features} is not a multiple of {per_word} ({spec.layout}, {spec.bits}-bit): "
            f"{spec.method} packs qzeros along the output rows in whole int32 words, so the checkpoint cannot hold all "
            "its zero points (vLLM refuses this output size too); re-export it as compressed-tensors pack-quantized, "
            "or with this module dense")
    known = set(spec.required_tensor_names()) | set(spec.optional_tensor_names())
    if spec.method == "modelopt" and (extra := sorted(set(tensors) - known - _MODELOPT_OTHER_TENSORS)):
        # pre_quant_scale (AWQ smoothing), weight_scale_2 (NVFP4), an input_scale of per-token activations: each would
        # change the numbers, and FP8 / FP8_PER_CHANNEL_PER_TOKEN define none of them
        algo = "FP8_PER_CHANNEL_PER_TOKEN" if spec.is_per_channel else "FP8"
        raise CheckpointError(f"{module_name} has {extra}, which ModelOpt {algo} does not define (it stores "
                              f"{sorted(known)}): the config does not describe the tensors")
    for name, shape in expected_shapes(spec, in_features, out_features).items():
        if name not in tensors or name not in known:
            continue
        actual = tuple(tensors[name].shape)
        # FP8 scales appear as [n], [n, 1] or [] across versions: compare without unit dims.
        is_match = (
            ([d for d in actual if d != 1] == [d for d in shape if d != 1])
            if (_is_scale(name) and not spec.block_size) or (spec.layout == "int-quantized" and name == "weight_zero_point")
            else actual == shape
            # compressed-tensors before zero-point packing (PR #296, 2025) saved them unpacked: [out, G]
            or (name == "weight_zero_point" and actual == (out_features, shape[1]))
        )
        if not is_match:
            raise CheckpointError(
                f"{module_name}.{name} has shape {list(actual)}, expected {list(shape)} for {config} "
                f"with in_features {in_features}, out_features {out_features}; check quantization_config"
            )
    _check_dtypes(spec, module_name, tensors)
    if spec.layout == "int-quantized":
        if tensors["weight"].dtype != torch.int8:
            raise CheckpointError(f"{module_name}.weight has dtype {tensors['weight'].dtype}, expected int8 for "
                                  "compressed-tensors int-quantized (W8A8 int8)")
        zero_point = tensors.get("weight_zero_point")
        if zero_point is not None and bool(zero_point.ne(0).any()):
            raise CheckpointError(f"{module_name}.weight_zero_point is not all 0, but quantization_config says symmetric: "
                                  "the config does not describe the tensors")
    g_idx_name = "weight_g_idx" if spec.layout == "pack-quantized" else "g_idx"
    g_idx = tensors.get(g_idx_name) if g_idx_name in known else None
    if g_idx is not None and g_idx.numel():
        num_groups = spec.num_groups(in_features)
        low, high = int(g_idx.min()), int(g_idx.max())
        if low < 0 or high >= num_groups:
            raise CheckpointError(f"{module_name}.{g_idx_name} holds groups {low}..{high}, but {config} with in_features "
                                  f"{in_features} has groups 0..{num_groups - 1}: the checkpoint is damaged")
    recorded = tensors.get("weight_shape")  # compressed-tensors records the dense shape itself
    if recorded is not None and recorded.tolist() != [out_features, in_features]:
        raise CheckpointError(f"{module_name}.weight_shape says {recorded.tolist()}, but the model's config.json makes "
                              f"this module [{out_features}, {in_features}]: the checkpoint is damaged")
