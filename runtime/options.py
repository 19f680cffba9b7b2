"""Engine options: the artifact's runtime defaults, overridden by keyword (same names as the recipe)."""

from __future__ import annotations

import dataclasses

import torch

from llmc.errors import ConfigError
from llmc.runtime import artifact as art
from llmc.runtime.onnx_model import is_onnx, onnx_options
from llmc.schema import canonical_keys, parse


def resolve_options(manifest: art.Manifest, overrides: dict) -> art.RuntimeDefaults:
    """The artifact's runtime section with `overrides` applied, every value checked by name."""
    overrides = canonical_keys(art.RuntimeDefaults, overrides, "", ConfigError)  # vLLM's names too
    overrides = _check_vllm_build_settings(manifest, overrides)
    merged = {**dataclasses.asdict(manifest.runtime), **overrides}
    options = parse(art.RuntimeDefaults, merged, "", ConfigError)
    if options.max_model_len > manifest.model.max_position_embeddings and manifest.model.rope_scaling is None:
        raise ConfigError(
            f"max_model_len {options.max_model_len} exceeds the model's max_position_embeddings "
            f"({manifest.model.max_position_embeddings}); lower it"
        )
    if options.num_scheduler_steps > 1:
        _check_multi_step(manifest, options)
    if is_onnx(manifest):
        _check_onnx_memory_knobs(options)
        options = onnx_options(manifest, options, overrides)
    return options


def _check_vllm_build_settings(manifest: art.Manifest, overrides: dict) -> dict:
    """vLLM's engine arguments that llmc decides at build time (tensor_parallel_size,
    pipeline_parallel_size, dtype) or always does (enable_chunked_prefill): accepted where they say what
    the artifact does, refused by name where they ask for something else; trust_remote_code is
    accepted either way (no code of the checkpoint runs). Returns the other overrides."""
    rest = dict(overrides)
    plan = manifest.parallel
    for name, built, key in [("tensor_parallel_size", plan.tensor, "tensor"), ("pipeline_parallel_size", plan.pipeline, "pipeline")]:
        if name in rest and rest.pop(name) != built:
            raise ConfigError(f"{name} {overrides[name]!r}: this artifact is split {built} way(s) at build time "
                              f"(the recipe's parallel.{key}); build it again with parallel.{key}: {overrides[name]}")
    if "dtype" in rest:  # vLLM's names and its "half" / "float" spellings
        dtype = rest.pop("dtype")
        named = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32", "fp32": "float32"}.get(dtype, dtype)
        if named not in ("auto", manifest.model.dtype):
            raise ConfigError(f"dtype {dtype!r}: this artifact holds {manifest.model.dtype} weights (the recipe's dtype); "
                              f"build it again with dtype: {named}, or drop dtype")
    rest.pop("trust_remote_code", None)  # a permission, not a setting: an artifact never runs a checkpoint's code
    if "enable_chunked_prefill" in rest and rest.pop("enable_chunked_prefill") is not True:
        raise ConfigError(f"enable_chunked_prefill {overrides['enable_chunked_prefill']!r}: llmc always prefills a "
                          "prompt in chunks of at most max_num_batched_tokens tokens beside the running decodes; "
                          "drop it, or raise max_num_batched_tokens for larger chunks")
    return rest


def _check_multi_step(manifest: art.Manifest, options: art.RuntimeDefaults) -> None:
    steps = options.num_scheduler_steps
    if not is_onnx(manifest):
        raise ConfigError(f"num_scheduler_steps {steps}: multi-step decoding runs on onnx-cpu artifacts only (the torch "
                          "runtime overlaps steps instead: async_scheduling); use num_scheduler_steps 1")
    if options.speculative is not None:
        raise ConfigError(f"num_scheduler_steps {steps} cannot be combined with speculative decoding; "
                          "drop one of them")


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
