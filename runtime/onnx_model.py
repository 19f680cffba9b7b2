"""The ONNX model format of an artifact (target `onnx-cpu`): what the graph's inputs and outputs are,
and the engine options it allows. Shared by the compiler (which writes the graph) and the runtime
(runtime/onnx_runner.py runs it on onnxruntime); importing this module does not import onnxruntime.

The graph (one file, weights as external data beside it):

  inputs   input_ids               int64   [batch, seq]          right-padded token chunks
           past_key.{i}            float32 [batch, kv_heads, capacity, head_dim]   layer i's K cache
           past_value.{i}          float32 [batch, kv_heads, capacity, head_dim]   layer i's V cache
           seqlens_k               int32   [batch]   tokens in the cache after this step, minus 1
           total_sequence_length   int32   []        an upper bound of seqlens_k + 1
           query_seqlens           int32   [batch]   valid (non-padded) tokens of each chunk (0: idle)
           logits_indices          int64   [rows]    rows of the flattened [batch * seq] to take logits of
  outputs  logits                  float32 [rows, vocab]
           hidden_states           float32 [batch * seq, hidden]   the final norm's outputs of every
                                   position (transformers' last_hidden_state, flattened): what a pooling
                                   (embedding) step binds, with no logits rows; generation leaves it unbound
           present_key.{i}, present_value.{i}: the same buffers as past_* (the runner binds one buffer
           to both: GroupQueryAttention writes the new rows in place)

KV layout: one buffer per layer for all sequence slots ([num_slots, kv_heads, max_model_len, head_dim]);
a step binds the slice of the slots it runs. There are no blocks: the scheduler's block count only
bounds the tokens in flight, and prefix caching (which shares blocks between sequences) is off.
"""

from __future__ import annotations

import dataclasses
import logging

from llmc.errors import ConfigError
from llmc.runtime import artifact as art

logger = logging.getLogger("llmc")

MODEL_FORMAT = "onnx"
ONNX_DEVICES = ("onnx-cpu",)  # recipe target.device values that build an ONNX model
MODEL_PATH = "onnx/model.onnx"
DATA_NAME = "model.onnx.data"  # external data, beside the graph
COMPUTE_DTYPE_BYTES = 4  # the graph computes (and caches K/V) in float32: CPUs run bf16/fp16 slowly

INPUT_IDS, SEQLENS_K, TOTAL_SEQUENCE_LENGTH = "input_ids", "seqlens_k", "total_sequence_length"
QUERY_SEQLENS, LOGITS_INDICES, LOGITS = "query_seqlens", "logits_indices", "logits"
HIDDEN_STATES = "hidden_states"  # graphs built before session 41 lack it: they cannot pool
CLASSIFIER_WEIGHT = "score.weight_t"  # a sequence classifier's head [hidden, num_labels]: its logits' projection


def past_names(layer: int) -> tuple[str, str]:
    return f"past_key.{layer}", f"past_value.{layer}"


def present_names(layer: int) -> tuple[str, str]:
    return f"present_key.{layer}", f"present_value.{layer}"


def logits_width(model: art.ModelConfig) -> int:
    """The graph's logits columns: the vocabulary, or a sequence classifier's labels (its head is `score`)."""
    return model.num_labels if model.is_classifier else model.vocab_size


def is_onnx(manifest: art.Manifest) -> bool:
    """Whether the artifact's model is an ONNX graph (else the torch runtime's safetensors)."""
    return manifest.target.get("model_format") == MODEL_FORMAT


def slot_bytes(model: art.ModelConfig, max_model_len: int) -> int:
    """KV bytes of one sequence slot: max_model_len tokens of K and V in every layer, float32."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * COMPUTE_DTYPE_BYTES * max_model_len


def num_kv_slots(model: art.ModelConfig, options: art.RuntimeDefaults) -> int:
    """Sequence slots the KV budget holds: num_kv_blocks' tokens if set, else cpu_kv_cache_gib."""
    if options.num_kv_blocks is not None:
        return options.num_kv_blocks * options.block_size // options.max_model_len
    return int(options.cpu_kv_cache_gib * (1 << 30)) // slot_bytes(model, options.max_model_len)


def onnx_options(manifest: art.Manifest, options: art.RuntimeDefaults, overrides: dict) -> art.RuntimeDefaults:
    """The engine options an ONNX artifact runs with: no prefix caching (KV lives in per-sequence
    slots, not shared blocks), and at most as many sequences as the KV budget has slots.

    What the caller set explicitly and cannot hold is an error; defaults are fitted with a log line.
    """
    if options.enable_prefix_caching:
        if overrides.get("enable_prefix_caching"):
            raise ConfigError("enable_prefix_caching: an ONNX artifact keeps each sequence's KV in its own slot and "
                              "cannot share prefixes; drop the option (or set it false)")
        logger.info("enable_prefix_caching: off (an ONNX artifact keeps each sequence's KV in its own slot)")
        options = dataclasses.replace(options, enable_prefix_caching=False)
    rows = manifest.target.get("onnx", {}).get("max_positions", manifest.model.max_position_embeddings)
    if options.max_model_len > rows:
        raise ConfigError(f"max_model_len {options.max_model_len} exceeds the {rows} positions the ONNX graph's "
                          "rotary tables hold; lower it, or rebuild with a larger runtime.max_model_len")
    num_slots = num_kv_slots(manifest.model, options)
    if num_slots < 1:
        if options.num_kv_blocks is not None:
            raise ConfigError(f"num_kv_blocks {options.num_kv_blocks} holds {options.num_kv_blocks * options.block_size} "
                              f"tokens, fewer than one sequence of max_model_len {options.max_model_len}; raise it to at "
                              f"least {-(-options.max_model_len // options.block_size)}, or lower max_model_len")
        need = slot_bytes(manifest.model, options.max_model_len) / (1 << 20)
        raise ConfigError(f"one sequence of max_model_len {options.max_model_len} needs {need:.1f} MiB of KV cache, "
                          f"more than cpu_kv_cache_gib {options.cpu_kv_cache_gib}; raise it, or lower max_model_len")
    if options.max_num_seqs > num_slots:
        if "max_num_seqs" in overrides:
            raise ConfigError(f"max_num_seqs {options.max_num_seqs}: the KV budget holds {num_slots} sequences of "
                              f"max_model_len {options.max_model_len}; lower max_num_seqs or max_model_len, "
                              "or raise cpu_kv_cache_gib")
        logger.info("ONNX runtime: max_num_seqs %d -> %d (sequence slots of max_model_len %d in the KV budget)",
                    options.max_num_seqs, num_slots, options.max_model_len)
        options = dataclasses.replace(options, max_num_seqs=num_slots)
    return options
