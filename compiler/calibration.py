"""Calibration: text → token windows, and running the runtime's own decoder layers one at a time.

The same `DecoderLayer` the runtime serves with runs here in float32 over the calibration windows,
with a scratch paged KV cache, so a build needs one layer's weights plus the activations in memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

from llmc.compiler.convert import LayerWeights, stack_experts
from llmc.errors import CheckpointError, RecipeError
from llmc.quant.formats import DenseFormat
from llmc.runtime.artifact import ModelConfig
from llmc.runtime.forward_batch import ForwardBatch
from llmc.runtime.models.decoder import DecoderLayer, layer_table, nope_table, rope_tables
from llmc.runtime.models.spec import format_key
from llmc.runtime.parallel.layout import kv_cache_shapes

BLOCK_SIZE = 16


# Dataset files other than text and JSON: read as text they would calibrate on their markup or bytes.
_UNREAD_SUFFIXES = (".csv", ".tsv", ".parquet", ".arrow", ".gz", ".bz2", ".xz", ".zst", ".zip", ".tar")


def read_text(path: str | Path) -> str:
    """A .txt file as is; a .jsonl file's "text" fields joined by blank lines; a .json file likewise,
    as a JSON array of {"text": ...} objects or as JSON Lines (what `datasets`' json loader reads).
    UTF-8 only."""
    path = Path(path)
    key = "quantization.calibration.data"
    if path.suffix.lower() in _UNREAD_SUFFIXES:
        raise RecipeError(f"{key}: {path}: {path.suffix} files are not read; give a .txt file, or a .jsonl / .json "
                          "file of {\"text\": ...} records")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise RecipeError(f"{key}: {path} is not UTF-8 text (byte {e.start}: {e.reason}); give a .txt or .jsonl file") from None
    except OSError as e:
        raise RecipeError(f"{key}: cannot read {path} ({e.strerror})") from None
    if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
        return _json_array_text(text, path, key)
    if path.suffix.lower() not in (".jsonl", ".json"):
        return text
    texts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise RecipeError(f"{key}: {path} line {number} is not JSON ({e})") from None
        if not (isinstance(record, dict) and isinstance(record.get("text"), str)):
            raise RecipeError(f"{key}: {path} line {number} must be an object with a \"text\" string")
        texts.append(record["text"])
    return "\n\n".join(texts)


def _json_array_text(text: str, path: Path, key: str) -> str:
    try:
        records = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise RecipeError(f"{key}: {path} is not JSON ({e})") from None
    for number, record in enumerate(records):
        if not (isinstance(record, dict) and isinstance(record.get("text"), str)):
            raise RecipeError(f"{key}: {path} item {number} must be an object with a \"text\" string")
    return "\n\n".join(record["text"] for record in records)


def calibration_windows(tokenizer, path: str | Path, num_samples: int, seq_len: int, seed: int | None,
                        num_eval: int = 0, vocab_size: int | None = None) -> tuple[Tensor, Tensor]:
    """Tokenize the file once and cut it into non-overlapping windows of seq_len - 1 tokens, each
    given the bos token first. Returns (calibration windows [num_samples, seq_len], held-out
    windows [num_eval, seq_len]). With seed None the calibration windows are the first ones, in
    order, and the held-out ones the file's last; with a seed all are drawn at random. Calibration
    never sees a held-out window. Every id must be below `vocab_size` (the model's embedding rows)."""
    token_ids = tokenizer.encode(read_text(path), add_special_tokens=False, verbose=False)
    if vocab_size is not None and token_ids and max(token_ids) >= vocab_size:
        raise CheckpointError(f"the checkpoint's tokenizer gives token id {max(token_ids)} for "
                              f"quantization.calibration.data, but its model has {vocab_size} embeddings (config.json "
                              "vocab_size): the tokenizer does not belong to this model")
    body = seq_len - 1
    num_windows = len(token_ids) // body
    if num_windows < num_samples + num_eval:
        raise RecipeError(
            f"quantization.calibration.data: {path} has {len(token_ids)} tokens, enough for {num_windows} windows "
            f"of {seq_len}; num_samples ({num_samples}){f' + {num_eval} held-out' if num_eval else ''} need more "
            "text, fewer samples or a shorter seq_len"
        )
    if seed is None:
        calib, held_out = torch.arange(num_samples), torch.arange(num_windows - num_eval, num_windows)
    else:
        chosen = torch.randperm(num_windows, generator=torch.Generator().manual_seed(seed))[: num_samples + num_eval]
        calib, held_out = chosen[:num_samples].sort().values, chosen[num_samples:].sort().values
    windows = torch.tensor(token_ids[: num_windows * body]).view(num_windows, body)
    bos = torch.full((num_windows, 1), tokenizer.bos_token_id if tokenizer.bos_token_id is not None else token_ids[0])
    windows = torch.cat([bos, windows], dim=1)  # [num_windows, seq_len]
    return windows[calib], windows[held_out]


def embed_windows(embed: Tensor, ids: Tensor, config: ModelConfig) -> Tensor:
    """The first layer's inputs for token windows ids [w, seq_len]: embedding rows, times the model's
    embed_scale where it has one (Gemma), as the runtime's DecoderModel.embed_tokens."""
    hidden = embed[ids]
    return hidden if config.embed_scale is None else hidden * config.embed_scale


class LayerRunner:
    """Runs one decoder layer (float32, dense) over [num_windows, seq_len, hidden] hidden states."""

    def __init__(self, config: ModelConfig, seq_len: int, device: torch.device, windows_per_chunk: int = 8):
        self.config = ModelConfig(**{**config.__dict__, "dtype": "float32"})
        self.seq_len = seq_len
        self.device = device
        self.windows_per_chunk = windows_per_chunk
        self.cos_sin, self.cos_sin_local, self.cos_sin_none = (
            None if t is None else t.to(device) for t in (*rope_tables(config, seq_len), nope_table(config, seq_len)))
        num_blocks = windows_per_chunk * -(-seq_len // BLOCK_SIZE)
        self.kv_cache = tuple(torch.zeros(shape, device=device)
                              for shape in kv_cache_shapes(config, config.num_kv_heads, num_blocks, BLOCK_SIZE))

    def build_layer(self, layer: LayerWeights) -> DecoderLayer:
        """A float32 DecoderLayer holding `layer`'s (possibly already fake-quantized) weights."""
        prefix = f"layers.{layer.index}."
        dense = DenseFormat(torch.float32)
        formats = {prefix + format_key(name): dense for name in layer.linears}
        with torch.device("meta"):
            module = DecoderLayer(self.config, formats, layer.index, torch.float32)
        set_layer_weights(module, layer, self.device)
        if module.holds_kv:  # (a state layer keeps no cache; an MLP alone, Nemotron-H's, has no attention)
            module.attn.kv_cache = self.kv_cache
        if module.is_mla:  # the expanded form on every window: kv_b sees its inputs (GPTQ, AWQ capture them)
            module.attn.absorb_kv_b()
            module.attn.form = "expanded"
        return module

    @torch.inference_mode()
    def forward(self, module: DecoderLayer, hidden: Tensor, observe_kv=None) -> Tensor:
        """hidden [num_windows, seq_len, hidden_size] → the layer's output, same shape.
        observe_kv(k_cache, v_cache) (MLA: observe_kv(latent_cache)): called after each chunk of windows with the
        scratch cache,
        zeroed before the chunk, so it holds that chunk's keys and values (post-rotary) and zeros."""
        out = torch.empty_like(hidden)
        for start in range(0, hidden.shape[0], self.windows_per_chunk):
            chunk = hidden[start : start + self.windows_per_chunk].to(self.device)  # [w, seq_len, hidden]
            batch = self._batch(chunk.shape[0])
            if observe_kv is not None:
                for cache in self.kv_cache:
                    cache.zero_()
            x, residual = module(chunk.flatten(0, 1), None, batch,
                                 layer_table(module, self.cos_sin, self.cos_sin_local, self.cos_sin_none))
            if observe_kv is not None:
                observe_kv(*self.kv_cache)
            out[start : start + chunk.shape[0]] = (x + residual).view_as(chunk).to(out.device)
        return out

    @torch.inference_mode()
    def capture_paired(self, module: DecoderLayer, hidden: Tensor, float_module: DecoderLayer, hidden_float: Tensor,
                       names: list[str], observe) -> None:
        """Run `module` on hidden and `float_module` on hidden_float (both [num_windows, seq_len, hidden]),
        a chunk of windows at a time, calling observe(name, x, x_float) with each named linear's inputs
        in both for the same tokens ([num_tokens, in_features] each)."""
        inputs = {}
        for start in range(0, hidden.shape[0], self.windows_per_chunk):
            chunk = slice(start, start + self.windows_per_chunk)
            for key, mod, states in (("x", module, hidden), ("x_float", float_module, hidden_float)):
                handles = capture_inputs(mod, names, lambda n, x, key=key: inputs.__setitem__((key, n), x))
                self.forward(mod, states[chunk])
                for handle in handles:
                    handle.remove()
            for name in names:
                observe(name, inputs["x", name], inputs["x_float", name])

    def _batch(self, num_windows: int) -> ForwardBatch:
        blocks_per_window = -(-self.seq_len // BLOCK_SIZE)
        positions = torch.arange(self.seq_len, device=self.device).repeat(num_windows)
        window = torch.arange(num_windows, device=self.device).repeat_interleave(self.seq_len)
        slots = window * blocks_per_window * BLOCK_SIZE + positions
        tables = torch.arange(num_windows * blocks_per_window, device=self.device, dtype=torch.int32)
        return ForwardBatch(
            positions=positions,
            slot_mapping=slots,
            block_tables=tables.view(num_windows, blocks_per_window),
            context_lens=torch.full((num_windows,), self.seq_len, dtype=torch.int32, device=self.device),
            query_lens=[self.seq_len] * num_windows,
            max_context_len=self.seq_len,
            logits_indices=torch.empty(0, dtype=torch.long, device=self.device),
        )


def set_layer_weights(module: DecoderLayer, layer: LayerWeights, device: torch.device) -> None:
    tensors = {f"{name}.weight": w for name, w in layer.linears.items()}
    tensors |= {f"{name}.bias": b for name, b in layer.biases.items()}
    tensors |= {f"{name}.weight": w for name, w in layer.norms.items()}
    for name, tensor in stack_experts({k: v.float() for k, v in tensors.items()}).items():
        owner, _, attr = name.rpartition(".")
        setattr(module.get_submodule(owner), attr, tensor.float().to(device))


def capture_inputs(module: DecoderLayer, names: list[str], observe) -> list:
    """Register hooks calling observe(name, x [num_tokens, in_features]) on each named linear's input."""
    handles = []
    experts = [name for name in names if name.startswith("moe.experts.")]
    if experts:  # routed inputs, reported by the MoE's plain-torch path (runtime/models/moe.py)
        handles.append(_ExpertObservation(module.moe, set(experts), observe))
    for name in names:
        if name in experts:
            continue
        linear = module.get_submodule(name)
        handles.append(linear.register_forward_pre_hook(lambda _m, args, n=name: observe(n, args[0].reshape(-1, args[0].shape[-1]))))
    return handles


class _ExpertObservation:
    """An observer on an MoE layer's experts, removable like a hook handle."""

    def __init__(self, moe, names: set[str], observe):
        self.moe = moe
        self.callback = lambda name, x: observe(name, x) if name in names else None
        moe.observers.append(self.callback)

    def remove(self) -> None:
        self.moe.observers.remove(self.callback)
