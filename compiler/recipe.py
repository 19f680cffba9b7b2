"""Recipes: YAML → frozen dataclasses, strictly checked (unknown keys, types, ranges, paths).

Relative paths (model, output, calibration data) are resolved from the current directory.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from llmc.compiler.gguf_checkpoint import gguf_stem, is_gguf
from llmc.compiler.lora import adapter_key, check_adapter_dir
from llmc.errors import RecipeError
from llmc.runtime.artifact import RuntimeDefaults, upper_cudagraph_mode
from llmc.schema import opt, parse

logger = logging.getLogger("llmc")

QUANT_METHODS = ["none", "rtn", "gptq", "awq", "fp8", "int8", "import"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class CalibrationConfig:
    data: str | None = opt(None, help="a .txt, .jsonl or .json ({\"text\": ...} records) file of calibration text")
    num_samples: int = opt(128, min=1, help="number of calibration windows")
    seq_len: int = opt(512, min=2, help="tokens per calibration window")
    shuffle: bool = opt(False, help="draw the windows at random (by seed) instead of taking them in order")
    seed: int = opt(0, min=0, max=2**63 - 1, help="seed for drawing windows when shuffle is true")


@dataclass(frozen=True)
class QuantOverride:
    match: str = opt(help="module name pattern (fnmatch, or 're:' + regex)")
    bits: int | None = opt(None, choices=[3, 4, 8])
    group_size: int | None = opt(None, choices=[32, 64, 128, -1])
    symmetric: bool | None = opt(None)


@dataclass(frozen=True)
class QuantizationConfig:
    method: str = opt("none", choices=QUANT_METHODS, help="quantization algorithm, or import of a quantized checkpoint")
    bits: int = opt(4, choices=[3, 4, 8], help="weight bits of int methods")
    group_size: int = opt(128, choices=[32, 64, 128, -1], help="input columns per scale; -1 = per output channel")
    symmetric: bool = opt(True, help="false stores zero points")
    act_order: bool = opt(False, help="gptq: columns by decreasing Hessian diagonal")
    damp_percent: float = opt(0.01, min_exclusive=0.0, max=1.0,
                              help="gptq (and float targets): dampening, fraction of the Hessian's mean diagonal")
    float_targets: bool = opt(True, help="gptq: fit each linear to the float model's output from the quantized "
                                         "model's inputs (GPTAQ); false: to the float layer's on those inputs")
    ignore: list[str] = opt(["lm_head"], help="module name patterns left unquantized")
    overrides: list[QuantOverride] = opt([], help="per-module settings, first match wins")
    calibration: CalibrationConfig = opt(CalibrationConfig(), help="calibration data for gptq, awq, fp8 static")
    weights: str = opt("per_channel", choices=["per_channel", "per_tensor", "block"], help=(
        "fp8, int8: weight scale granularity (int8: per_channel only); fp8 block: one scale per 128 x 128 block of "
        "the weights and per token and 128 inputs of the activations (llm-compressor's FP8_BLOCK, dynamic only)"))
    activations: str = opt("dynamic", choices=["dynamic", "static"], help="fp8, int8: per-token dynamic or calibrated "
                                                                          "static (int8: dynamic only)")
    algorithm: str = opt("rtn", choices=["rtn", "gptq"], help="int8: how the weights are rounded: to nearest, or GPTQ "
                                                              "(needs calibration data)")
    smoothquant: float | None = opt(None, min=0.0, max=1.0, help=(
        "int8: SmoothQuant's smoothing_strength alpha (llm-compressor's default 0.8), folded into the norms before "
        "qkv and gate_up from the calibration inputs (needs calibration data); null or 0: off"))
    report: bool = opt(True, help="measure quality at build time and record it in the manifest")
    min_expert_tokens: int = opt(128, min=0, help="MoE: an expert routed fewer calibration tokens than this is "
                                                  "quantized with RTN instead (gptq, awq, fp8 static); the report lists them")


@dataclass(frozen=True)
class ParallelConfig:
    tensor: int = opt(1, min=1, help="tensor parallel size")
    pipeline: int = opt(1, min=1, help="pipeline parallel size")
    expert: int = opt(1, min=1, help="MoE models: spread whole experts over this many ranks (vLLM's "
                                     "enable_expert_parallel); 1 or equal to tensor (attention stays tensor-parallel)")


@dataclass(frozen=True)
class TargetConfig:
    device: str = opt("cuda", choices=["cuda", "cpu", "onnx-cpu"],
                      help="where the artifact will run; onnx-cpu: an ONNX graph (int4 MatMulNBits) for onnxruntime's CPU EP")
    gpu_memory_gib: float | None = opt(None, min_exclusive=0.0, max=65536.0, help="GPU memory to plan for (default: 80)")
    tune_kernels: bool = opt(False, help="measure the W4A16 kernels for the artifact's shapes on this machine's GPU "
                                         "(cuda target) and record them; false: the recorded H100 table and a heuristic")
    int4_accuracy_level: int | None = opt(None, choices=[1, 4], help=(
        "onnx-cpu: MatMulNBits' accuracy_level (onnxruntime-genai's int4_accuracy_level). 4: each block of "
        "activations is quantized to int8 for the int4 dot products (genai's and llama.cpp's CPU default, about "
        "2x faster decode, activations rounded too); 1: float32 on the dequantized weights (the quantized model "
        "exactly, the torch runtime's tokens). Default 1"))


@dataclass(frozen=True)
class Recipe:
    model: str = opt(help="local HF checkpoint directory (or a hub id, when online), or a .gguf file (llama.cpp's; "
                          "a gguf-split set by its first file)")
    tokenizer: str | None = opt(None, help="a .gguf model's tokenizer: an HF tokenizer directory (vLLM's --tokenizer); "
                                           "default: made from the GGUF's own tokenizer metadata")
    revision: str | None = opt(None, help="hub revision, when model is a hub id")
    adapter: list[str] = opt([], help="PEFT LoRA adapter directories (one path, or a list merged in order) merged "
                                      "into the weights before quantization")
    hf_overrides: dict = opt({}, help="keys set over the checkpoint's config.json before it is read (vLLM's "
                                      "hf_overrides), e.g. architectures and classifier_from_token to serve a causal "
                                      "reranker as a classifier")
    output: str | None = opt(None, help="artifact directory (default: build/<model name>)")
    dtype: str = opt("auto", choices=["auto", "bfloat16", "float16", "float32"], help="weights and activations dtype")
    quantization: QuantizationConfig = opt(QuantizationConfig())
    parallel: ParallelConfig = opt(ParallelConfig())
    runtime: RuntimeDefaults = opt(RuntimeDefaults())
    target: TargetConfig = opt(TargetConfig())

    @property
    def output_dir(self) -> Path:
        if self.output:
            return Path(self.output)
        if is_gguf(self.model):
            return Path("build") / (gguf_stem(self.model) or "model")
        model = Path(self.model.rstrip("/") or "/")
        name = model.name if self.is_hub_id else Path(os.path.abspath(model)).name  # "." and ".." name a folder
        return Path("build") / (name or "model")

    @property
    def is_hub_id(self) -> bool:
        return not Path(self.model).exists() and bool(_HUB_ID.match(self.model)) and not is_gguf(self.model)


def load_recipe(path: str | Path) -> Recipe:
    path = Path(path)
    if not path.exists() or path.is_dir():  # a pipe (`llmc build <(...)`) reads as well as a file
        raise RecipeError(f"recipe file {path} does not exist" if not path.exists() else f"{path} is a directory, "
                          "not a recipe file")
    try:
        data = _load_yaml(path.read_text(encoding="utf-8"), str(path))
    except yaml.YAMLError as e:
        raise RecipeError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    except (UnicodeDecodeError, RecursionError) as e:
        raise RecipeError(f"{path}: not a YAML text file ({type(e).__name__}: {e})") from None
    return recipe_from_dict(data, source=str(path))


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (PyYAML keeps the last one, silently)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark.line + 1)
                except TypeError:  # an unhashable key: SafeLoader's own error follows
                    continue
                if first != key_node.start_mark.line + 1:
                    raise RecipeError(f"{self.name}: line {key_node.start_mark.line + 1}: key {key!r} is given twice "
                                      f"(first on line {first}); keep one")
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str, name: str):
    loader = _StrictLoader(text)
    loader.name = name
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def recipe_from_dict(data: dict, source: str = "recipe") -> Recipe:
    if isinstance(data, dict) and isinstance(data.get("runtime"), dict):
        data = {**data, "runtime": upper_cudagraph_mode(data["runtime"])}
    if isinstance(data, dict) and isinstance(data.get("adapter"), str):  # one adapter: a path, not a list of one
        data = {**data, "adapter": [data["adapter"]]}
    try:
        recipe = parse(Recipe, data, "", RecipeError)
        _check_method_keys(recipe.quantization.method, data.get("quantization") or {})
        _check(recipe, data.get("runtime") if isinstance(data.get("runtime"), dict) else {})
    except RecipeError as e:
        raise RecipeError(f"{source}: {e}") from None
    return recipe


_INT_KEYS = ("bits", "group_size", "symmetric")
_GPTQ_KEYS = ("act_order", "damp_percent", "float_targets")
_FP8_KEYS = ("weights", "activations")
_INT8_KEYS = ("algorithm", "smoothquant")
_KEYS_WITHOUT_EFFECT = {  # quantization keys that a method does not read (import reads the checkpoint's own)
    "none": (*_INT_KEYS, *_GPTQ_KEYS, *_FP8_KEYS, *_INT8_KEYS, "overrides", "min_expert_tokens"),
    "rtn": (*_GPTQ_KEYS, *_FP8_KEYS, *_INT8_KEYS, "min_expert_tokens"),
    "awq": (*_GPTQ_KEYS, *_FP8_KEYS, *_INT8_KEYS),
    "gptq": (*_FP8_KEYS, *_INT8_KEYS),
    "fp8": (*_INT_KEYS, *_GPTQ_KEYS, *_INT8_KEYS),
    "int8": ("bits", "group_size"),  # (symmetric: false, per_tensor and static are refused; gptq keys: see below)
    "import": _INT8_KEYS,
}


def _check_method_keys(method: str, section: dict) -> None:
    """A quantization key the method does not read is named in a warning (it changed nothing, silently,
    before; a warning rather than an error, because recipes often carry an int method's keys when they
    switch the method)."""
    unused = [key for key in _KEYS_WITHOUT_EFFECT.get(method, ()) if key in section]
    if method == "int8" and section.get("algorithm", "rtn") != "gptq":
        unused += [key for key in _GPTQ_KEYS if key in section]
    if method in ("fp8", "int8"):
        unused += [f"overrides[{i}].{key}" for i, o in enumerate(section.get("overrides") or [])
                   if isinstance(o, dict) for key in _INT_KEYS if key in o]
    calibration = section.get("calibration") if isinstance(section.get("calibration"), dict) else {}
    if "seed" in calibration and calibration.get("shuffle") is not True:
        logger.warning("quantization.calibration.seed: the windows are drawn by seed only with "
                       "quantization.calibration.shuffle: true (without it, the file's first windows, in order); "
                       "set shuffle: true, or drop seed")
    if unused:
        names = ", ".join(f"quantization.{key}" for key in unused)
        logger.warning("%s: method %s does not use %s; %s no effect", names, method,
                       "them" if len(unused) > 1 else "it", "they have" if len(unused) > 1 else "it has")


def _check_path_text(key: str, value: str | None) -> None:
    """`~` and `$VAR` are not expanded (a path is used as written, relative to the current directory): say so
    rather than look for, or create, a folder literally named `~`."""
    if value is None:
        return
    if not value.strip():
        raise RecipeError(f"{key}: an empty path; give a directory" + (" (or drop the key for the default)" if key == "output" else ""))
    if value.startswith("~") or re.search(r"\$(\w+|\{)", value):
        raise RecipeError(f"{key}: {value!r}: '~' and '$VARIABLES' are not expanded in recipes; write the path out "
                          f"(e.g. {os.path.expandvars(os.path.expanduser(value))!r})")


def check_output(recipe: Recipe) -> None:
    """The artifact directory must not be, hold or sit inside the checkpoint: an artifact replaces its output
    directory wholesale, and a build must never touch the checkpoint."""
    _check_path_text("output", recipe.output)
    if recipe.is_hub_id:
        return
    model = Path(os.path.realpath(recipe.model))
    output = Path(os.path.realpath(recipe.output_dir))
    if output == model or model in output.parents or output in model.parents:
        where = "is" if output == model else ("is inside" if model in output.parents else "holds")
        what = "checkpoint" if is_gguf(recipe.model) else "checkpoint directory"
        raise RecipeError(f"output: {recipe.output_dir} {where} the {what} {recipe.model}; choose "
                          "an output outside the checkpoint")


def check_adapters(recipe: Recipe) -> None:
    """Each adapter is a PEFT directory with its config and safetensors weights (their contents are checked
    against the checkpoint when the build reads it, compiler/lora.py)."""
    for i, path in enumerate(recipe.adapter):
        key = adapter_key(i, len(recipe.adapter))
        _check_path_text(key, path)
        check_adapter_dir(key, path)


def _check(recipe: Recipe, given_runtime: dict) -> None:
    """`given_runtime`: the recipe's runtime section as written (what it sets explicitly)."""
    _check_path_text("model", recipe.model)
    _check_path_text("quantization.calibration.data", recipe.quantization.calibration.data)
    check_output(recipe)
    check_adapters(recipe)
    model = Path(recipe.model)
    if not model.exists() and not recipe.is_hub_id:
        what = "file" if is_gguf(recipe.model) else "directory"
        raise RecipeError(f"model: {what} {recipe.model!r} does not exist (relative paths start at the current directory)")
    if model.exists() and not model.is_dir() and not is_gguf(recipe.model):
        raise RecipeError(f"model: {recipe.model!r} is a file; give the checkpoint's directory (or a .gguf file)")
    if is_gguf(recipe.model) and not model.is_file():
        raise RecipeError(f"model: {recipe.model!r} is not a file (a .gguf model is one file, or a gguf-split set's first)")
    _check_path_text("tokenizer", recipe.tokenizer)
    if recipe.tokenizer is not None and not is_gguf(recipe.model):
        raise RecipeError("tokenizer: applies to a .gguf model; an HF checkpoint's tokenizer is the one in its directory")
    if recipe.tokenizer is not None and not Path(recipe.tokenizer).is_dir():
        raise RecipeError(f"tokenizer: {recipe.tokenizer!r} is not a directory; give the HF tokenizer's directory")
    if recipe.revision is not None and not recipe.is_hub_id:
        raise RecipeError(f"revision: {recipe.revision!r} applies to a hub id, and model {recipe.model!r} is a local "
                          "directory (read as it is); drop revision, or check out that revision there")
    quant = recipe.quantization
    data = quant.calibration.data
    if quant.method == "int8":
        _check_int8(recipe)
    if quant.method == "fp8" and quant.weights == "block" and quant.activations == "static":
        raise RecipeError("quantization.activations: static with weights: block is not supported; block-scaled FP8 "
                          "quantizes the activations per token and 128 inputs at run time (dynamic)")
    if quant.method in ("gptq", "awq") or (quant.method == "fp8" and quant.activations == "static"):
        if data is None:
            raise RecipeError(f"quantization.calibration.data: method {quant.method} needs a calibration text file")
    if quant.method == "int8" and data is None and (quant.algorithm == "gptq" or quant.smoothquant):
        what = "algorithm gptq" if quant.algorithm == "gptq" else f"smoothquant {quant.smoothquant}"
        raise RecipeError(f"quantization.calibration.data: method int8 with {what} needs a calibration text file")
    if data is not None and not Path(data).is_file():
        what = "is not a regular file" if Path(data).exists() else "does not exist"
        raise RecipeError(f"quantization.calibration.data: {data!r} {what}")
    _check_runtime_target(recipe, given_runtime)
    patterns = [(f"quantization.ignore[{i}]", p) for i, p in enumerate(quant.ignore)]
    patterns += [(f"quantization.overrides[{i}].match", o.match) for i, o in enumerate(quant.overrides)]
    for key, pattern in patterns:
        _check_pattern(key, pattern)


def _check_int8(recipe: Recipe) -> None:
    """method int8 is llm-compressor's W8A8 int8 scheme only: what it is not is refused by name."""
    quant = recipe.quantization
    if quant.weights != "per_channel":
        raise RecipeError(f"quantization.weights: {quant.weights} int8 weights are not supported; method int8 stores "
                          "one scale per output channel (per_channel)")
    if quant.activations != "dynamic":
        raise RecipeError(f"quantization.activations: {quant.activations} int8 activations (calibrated scales) are not "
                          "supported; method int8 quantizes them per token at run time (dynamic)")
    if not quant.symmetric:
        raise RecipeError("quantization.symmetric: false (asymmetric int8 weights, zero points) is not supported by "
                          "method int8; set it true (or drop it)")
    for i, override in enumerate(quant.overrides):
        if override.bits not in (None, 8) or override.group_size not in (None, -1) or override.symmetric is False:
            raise RecipeError(f"quantization.overrides[{i}]: method int8 has one scheme (8 bits, per channel, "
                              "symmetric); an override may only send linears to ignore: use quantization.ignore")
    if quant.smoothquant is not None and quant.smoothquant >= 1.0:
        raise RecipeError(f"quantization.smoothquant: {quant.smoothquant}: the smoothing strength must be below 1 "
                          "(llm-compressor's default is 0.8); null or 0 turns smoothing off")


def _check_runtime_target(recipe: Recipe, given_runtime: dict) -> None:
    """Runtime settings the target cannot run, refused at build time rather than on every start: the
    memory knobs of the torch runtime and prefix caching (asked for in `given_runtime`) have no meaning
    for an ONNX model (float32 KV per sequence slot), multi-step decoding runs on onnx-cpu only, without speculation, and parallel ranks capture decode
    graphs only."""
    from llmc.runtime.options import graph_mode_problem, multi_step_problem
    from llmc.runtime.pooling import pooling_problem

    problem = multi_step_problem(recipe.runtime, recipe.target.device == "onnx-cpu")
    if problem is not None:
        raise RecipeError(f"runtime.{problem}")
    world_size = recipe.parallel.tensor * recipe.parallel.pipeline
    if (problem := pooling_problem(recipe.runtime, world_size)) is not None:
        raise RecipeError(f"runtime.{problem}")
    if (problem := graph_mode_problem(recipe.runtime, world_size)) is not None:
        raise RecipeError(f"runtime.{problem}")
    if recipe.target.device != "onnx-cpu":
        return
    if recipe.runtime.kv_cache_dtype != "auto":
        raise RecipeError(f"runtime.kv_cache_dtype: an onnx-cpu artifact keeps its KV cache in float32, not "
                          f"{recipe.runtime.kv_cache_dtype}; set it to auto (or drop it)")
    if recipe.runtime.cpu_offload_gb:
        raise RecipeError("runtime.cpu_offload_gb: an onnx-cpu artifact runs on the CPU, nothing to offload; drop it")
    if given_runtime.get("enable_prefix_caching") is True:  # its default (true) is turned off for onnx-cpu
        raise RecipeError("runtime.enable_prefix_caching: an onnx-cpu artifact has no paged KV blocks to share "
                          "(one slot per sequence); drop it or set it to false")


def _check_pattern(key: str, pattern: str) -> None:
    """A 're:' pattern must compile now, not halfway through a build."""
    if not pattern.startswith("re:"):
        return
    try:
        re.compile(pattern[3:])
    except re.error as e:
        raise RecipeError(f"{key}: {pattern!r} is not a valid regular expression ({e}); fix it") from None
