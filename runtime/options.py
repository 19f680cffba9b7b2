"""Engine options: the artifact's runtime defaults, overridden by keyword (same names as the recipe)."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch

from llmc.errors import ConfigError, RequestError
from llmc.runtime import artifact as art
from llmc.runtime.models import model_context_of
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.onnx_model import is_onnx, onnx_options

logger = logging.getLogger("llmc")
from llmc.schema import canonical_keys, parse


# generation_config.json keys that set a default of SamplingParams (vLLM's list), and the field each sets
GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(artifact_dir: Path, option: str) -> dict:
    """The SamplingParams fields a request leaves unset take from the model's generation config (vLLM's
    `generation_config`): "auto" reads the artifact's copy of the checkpoint's generation_config.json
    (none: no defaults), "vllm" none, anything else is a folder that must hold one. A value SamplingParams
    refuses is a ConfigError naming the file."""
    if option == "vllm":
        return {}
    folder = artifact_dir / art.TOKENIZER_DIR if option == "auto" else Path(option)
    path = folder / "generation_config.json"
    if not path.is_file():
        if option == "auto":
            return {}
        raise ConfigError(f"generation_config {option!r}: no generation_config.json in that folder; give a folder "
                          "that holds one, 'auto' (the model's) or 'vllm' (no model defaults)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{path}: not a readable JSON file ({type(e).__name__}); fix it or set generation_config "
                          "'vllm'") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: expected a JSON object; fix it or set generation_config 'vllm'")
    fields = {field: config[key] for key, field in GENERATION_FIELDS.items() if config.get(key) is not None}
    try:
        SamplingParams(**fields)
    except RequestError as e:
        raise ConfigError(f"{path}: {e} (the defaults it sets: {fields}); fix it or set generation_config 'vllm'") from None
    return fields


def resolve_options(manifest: art.Manifest, overrides: dict) -> art.RuntimeDefaults:
    """The artifact's runtime section with `overrides` applied, every value checked by name."""
    given_as = {f.name: f.metadata["alias"] for f in dataclasses.fields(art.RuntimeDefaults)
                if f.metadata.get("alias") in overrides}  # vLLM's names too: errors say the name given
    # a settings object (CompilationConfig(...), SpeculativeConfig(...)) as vLLM takes one, or its mapping
    overrides = {key: dataclasses.asdict(value) if dataclasses.is_dataclass(value) and not isinstance(value, type)
                 else value for key, value in overrides.items()}
    overrides = canonical_keys(art.RuntimeDefaults, overrides, "", ConfigError)
    overrides = _check_vllm_build_settings(manifest, overrides)
    overrides = art.upper_cudagraph_mode(overrides)
    merged = {**dataclasses.asdict(manifest.runtime), **overrides}
    if "max_model_len" in overrides and overrides["max_model_len"] is None:
        # vLLM's None: the model's context (with linear or YaRN rope scaling, the scaled one)
        merged["max_model_len"] = model_context_of(manifest.model)[0]
    try:
        options = parse(art.RuntimeDefaults, merged, "", ConfigError)
    except ConfigError as e:
        name = str(e).split(":", 1)[0].split(".", 1)[0]
        if name not in given_as:
            raise
        raise ConfigError(f"{given_as[name]}{str(e)[len(name):]}") from None
    if (problem := max_model_len_problem(options.max_model_len, manifest.model)) is not None:
        raise ConfigError(f"max_model_len {problem}")
    if (problem := state_dtype_problem(manifest.model, options)) is not None:
        raise ConfigError(problem)
    if manifest.model.is_hybrid:
        options = hybrid_options(manifest.model, options, overrides)
    if options.num_scheduler_steps > 1:
        _check_multi_step(manifest, options)
    if (problem := graph_mode_problem(options, manifest.parallel.world_size)) is not None:
        raise ConfigError(problem)
    if is_onnx(manifest):
        _check_onnx_memory_knobs(options)
        options = onnx_options(manifest, options, overrides)
    return options


def hybrid_options(model: art.ModelConfig, options: art.RuntimeDefaults, overrides: dict) -> art.RuntimeDefaults:
    """A hybrid model's options (Qwen3.5: Gated DeltaNet layers with a per-request state, runtime/models/
    gated_deltanet.py): what does not keep that state right is refused by name; prefix caching is off by default, as
    vLLM turns it off for hybrid models without its mamba prefix caching (a cached prefix has KV, not the state after
    it), refused where asked for."""
    kind = "Mamba-2" if model.mamba_layers else "short-conv" if model.short_conv_layers else "linear-attention"
    name = f"{model.architecture} (a hybrid model: its {kind} layers keep a recurrent state per request)"
    if overrides.get("enable_prefix_caching"):
        raise ConfigError(f"enable_prefix_caching: {name} has no prefix caching (a cached prefix holds KV, not the "
                          "state after it); drop it or set it false")
    refused = {"speculative_config": options.speculative is not None, "enable_lora": options.enable_lora,
               "num_scheduler_steps": options.num_scheduler_steps > 1}
    for key, asked in refused.items():
        if asked:
            raise ConfigError(f"{key}: not supported for {name} yet; drop it")
    if options.enable_prefix_caching:
        logger.info("enable_prefix_caching off: %s has no prefix caching (vLLM's default for hybrid models)", name)
        options = dataclasses.replace(options, enable_prefix_caching=False)
    return options


def state_dtype_problem(model: art.ModelConfig, options: art.RuntimeDefaults) -> str | None:
    """mamba_cache_dtype / mamba_ssm_cache_dtype set for a model without state layers, which would ignore them (the
    build says it of a recipe's too); None where they apply or are auto."""
    for name in ("mamba_cache_dtype", "mamba_ssm_cache_dtype"):
        value = getattr(options, name)
        if value != "auto" and not model.is_hybrid:
            return (f"{name} {value}: {model.architecture} has no Mamba, linear-attention or short-conv layers (no "
                    "state to store); drop it or set it auto")
    return None


def max_model_len_problem(max_model_len: int, model: art.ModelConfig) -> str | None:
    """What is wrong with a max_model_len beyond the model's context (rotary.model_context), or None; the
    build (a recipe's runtime.max_model_len) and the start (an override) say it alike."""
    limit, how = model_context_of(model)
    return None if max_model_len <= limit else f"{max_model_len} exceeds the model's context of {limit} ({how}); lower it"


# vLLM's LoRA engine arguments llmc does not take (its run-time LoRA: enable_lora, max_loras, max_lora_rank,
# max_cpu_loras, runtime/lora.py), with what to do instead
LORA_REFUSED = {
    "fully_sharded_loras": "shards adapters over tensor ranks; llmc's run-time LoRA runs on one rank: drop it",
    "lora_dtype": "adapters run in the model's dtype here: drop it",
    "lora_modules": "names adapters for the server (llmc run --enable-lora --lora-modules NAME=PATH); in Python "
                    "pass lora_request=LoRARequest(name, id, path) to generate",
}


# vLLM's prefix caching of hybrid models' states (its mamba cache modes), which llmc does not have (hybrid_options)
MAMBA_PREFIX_CACHING_REFUSED = ("mamba_block_size", "mamba_cache_mode")


def _check_vllm_build_settings(manifest: art.Manifest, overrides: dict) -> dict:
    """vLLM's engine arguments that llmc decides at build time (tensor_parallel_size,
    pipeline_parallel_size, dtype, quantization), always does (enable_chunked_prefill) or does in
    the server only (data_parallel_size): accepted where they say what
    the artifact does, refused by name where they ask for something else; trust_remote_code is
    accepted either way (no code of the checkpoint runs). Returns the other overrides."""
    rest = dict(overrides)
    for name, message in LORA_REFUSED.items():
        if name in rest:
            raise ConfigError(f"{name}: {message}")
    for name in MAMBA_PREFIX_CACHING_REFUSED:
        if name in rest:
            raise ConfigError(f"{name}: sets vLLM's prefix caching of a hybrid model's states, which llmc does not "
                              "have (a hybrid runs without prefix caching); drop it")
    plan = manifest.parallel
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
        value = rest.get(name)
        if name in rest and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"{name}: expected an integer >= 1, got {value!r}")
    if "trust_remote_code" in rest and not isinstance(rest["trust_remote_code"], bool):
        raise ConfigError(f"trust_remote_code: expected true or false, got {rest['trust_remote_code']!r}")
    for name, built, key in [("tensor_parallel_size", plan.tensor, "tensor"), ("pipeline_parallel_size", plan.pipeline, "pipeline")]:
        if name in rest and rest.pop(name) != built:
            raise ConfigError(f"{name} {overrides[name]!r}: this artifact is split {built} way(s) at build time "
                              f"(the recipe's parallel.{key}); build it again with parallel.{key}: {overrides[name]}")
    if "dtype" in rest:  # vLLM's names and its "half" / "float" spellings
        dtype = rest.pop("dtype")
        if isinstance(dtype, torch.dtype):  # vLLM takes a torch.dtype too
            dtype = str(dtype).removeprefix("torch.")
        if not isinstance(dtype, str):
            raise ConfigError(f"dtype: expected a string such as 'auto' or 'bfloat16', got {dtype!r}")
        named = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32",
                 "fp32": "float32"}.get(dtype.lower(), dtype.lower())  # vLLM's are case-insensitive
        if named not in ("auto", *art.DTYPES):
            raise ConfigError(f"dtype {dtype!r} is not a dtype; use auto, bfloat16, float16 or float32 "
                              "(or half, float), or drop it")
        if is_onnx(manifest):
            if named not in ("auto", "float32"):
                raise ConfigError(f"dtype {dtype!r}: an ONNX artifact computes in float32 whatever the recipe's dtype; "
                                  "use dtype float32 or auto, or drop it")
        elif named not in ("auto", manifest.model.dtype):
            raise ConfigError(f"dtype {dtype!r}: this artifact holds {manifest.model.dtype} weights (the recipe's dtype); "
                              f"build it again with dtype: {named}, or drop dtype")
    if rest.get("hf_overrides", 0) in (None, {}):  # vLLM's default: none
        rest.pop("hf_overrides")
    if "hf_overrides" in rest:
        raise ConfigError(f"hf_overrides {rest['hf_overrides']!r}: the model's config is read when the artifact is "
                          "built; set hf_overrides in the recipe and build it again")
    if "data_parallel_size" in rest and rest.pop("data_parallel_size") != 1:
        raise ConfigError(f"data_parallel_size {overrides['data_parallel_size']!r}: one engine runs one replica of the "
                          "model; serve N replicas with `llmc run ARTIFACT --data-parallel-size N`, or drop it")
    rest.pop("trust_remote_code", None)  # a permission, not a setting: an artifact never runs a checkpoint's code
    if rest.get("quantization", 0) is None:  # vLLM's default: the checkpoint's own
        rest.pop("quantization")
    if "quantization" in rest:
        _check_vllm_quantization(manifest, rest.pop("quantization"))
    if "enable_chunked_prefill" in rest and rest.pop("enable_chunked_prefill") is not True:
        raise ConfigError(f"enable_chunked_prefill {overrides['enable_chunked_prefill']!r}: llmc always prefills a "
                          "prompt in chunks of at most max_num_batched_tokens tokens beside the running decodes; "
                          "drop it, or raise max_num_batched_tokens for larger chunks")
    return rest


# vLLM's --quantization methods, by the weights they run: integer weights with 16-bit activations, FP8
# weights and activations, int8 weights and activations. An artifact's kernels are chosen at build time, so a method naming the artifact's
# kind of weights (awq or awq_marlin alike) is accepted; one naming another kind is refused.
_VLLM_INT_WEIGHT_METHODS = ("awq", "awq_marlin", "gptq", "gptq_marlin", "marlin", "gptq_bitblas", "bitblas",
                            "compressed-tensors", "moe_wna16", "rtn")
_VLLM_FP8_METHODS = ("fp8", "fbgemm_fp8", "ptpc_fp8", "compressed-tensors", "modelopt")
_VLLM_INT8_METHODS = ("compressed-tensors",)  # W8A8 int8 (int8 activations too): vLLM runs it through compressed-tensors
_VLLM_OTHER_METHODS = ("bitsandbytes", "gguf", "hqq", "torchao", "modelopt_fp4", "mxfp4", "experts_int8", "quark",
                       "auto-round", "deepspeedfp", "gptq_marlin_24", "qqq", "inc", "ipex", "tpu_int8", "petit_nvfp4")


def _check_vllm_quantization(manifest: art.Manifest, method) -> None:
    """vLLM's `quantization` (--quantization / -q): accepted where it names the kind of weights the artifact
    holds, refused by name otherwise (llmc quantizes at build time: the recipe's quantization.method)."""
    known = {*_VLLM_INT_WEIGHT_METHODS, *_VLLM_FP8_METHODS, *_VLLM_OTHER_METHODS}
    if not isinstance(method, str) or method not in known:
        raise ConfigError(f"quantization {method!r} is not one of vLLM's quantization methods; drop it (an artifact "
                          "is quantized at build time, by the recipe's quantization.method)")
    formats = {spec.get("format", "dense") for spec in manifest.quant.modules.values()} - {"dense"}
    kinds = {{"w8a8-fp8": "fp8", "w8a8-fp8-block": "fp8", "w8a8-int8": "int8"}.get(name, "int") for name in formats}
    accepted = {"int": _VLLM_INT_WEIGHT_METHODS, "fp8": _VLLM_FP8_METHODS, "int8": _VLLM_INT8_METHODS}
    if kinds and all(method in accepted[kind] for kind in kinds):
        return
    holds = ("unquantized weights" if not formats else f"{', '.join(sorted(formats))} weights "
             f"(quantization.method {manifest.quant.method} at build time)")
    raise ConfigError(f"quantization {method!r}: this artifact holds {holds}; drop the flag, or build the "
                      f"checkpoint again with the recipe's quantization.method set for {method}")


def _check_multi_step(manifest: art.Manifest, options: art.RuntimeDefaults) -> None:
    problem = multi_step_problem(options, is_onnx(manifest))
    if problem is not None:
        raise ConfigError(problem)


def graph_mode_problem(options: art.RuntimeDefaults, world_size: int) -> str | None:
    """What is wrong with compilation_config.cudagraph_mode for ranks of a world_size-way artifact (the
    build checks a recipe's too)."""
    mode = options.graph_modes.cudagraph_mode
    if mode in ("PIECEWISE", "FULL") and world_size > 1:
        return (f"compilation_config.cudagraph_mode {mode}: the ranks of a {world_size}-way artifact capture decode "
                "graphs only, and run other steps eagerly; use FULL_DECODE_ONLY (what FULL_AND_PIECEWISE gives them) "
                "or NONE")
    return None


def multi_step_problem(options: art.RuntimeDefaults, onnx: bool) -> str | None:
    """What is wrong with num_scheduler_steps > 1 in these options (the build checks a recipe's too)."""
    steps = options.num_scheduler_steps
    if steps > 1 and not onnx:
        return (f"num_scheduler_steps {steps}: multi-step decoding runs on onnx-cpu artifacts only (the torch "
                "runtime overlaps steps instead: async_scheduling); use num_scheduler_steps 1")
    if steps > 1 and options.speculative is not None:
        return f"num_scheduler_steps {steps} cannot be combined with speculative decoding; drop one of them"
    return None


def _check_onnx_memory_knobs(options: art.RuntimeDefaults) -> None:
    if options.kv_cache_dtype != "auto":
        raise ConfigError(f"kv_cache_dtype {options.kv_cache_dtype}: an ONNX artifact keeps its KV cache in "
                          "float32; use kv_cache_dtype auto")
    if options.cpu_offload_gb:
        raise ConfigError("cpu_offload_gb: an ONNX artifact runs on the CPU, nothing to offload; drop it")


def resolve_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"device {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r}: no CUDA GPU is available here; use --device cpu")
    return resolved
