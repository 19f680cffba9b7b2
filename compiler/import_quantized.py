"""`quantization.method: import`: an AutoAWQ, GPTQ or compressed-tensors checkpoint, unpacked and
re-packed into llmc's formats. No re-quantization: the levels, scales and zeros are the checkpoint's."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from llmc.compiler.convert import LayerWeights, read_layer
from llmc.compiler.hf_checkpoint import TensorReader
from llmc.errors import CheckpointError
from llmc.quant.formats import DenseFormat
from llmc.quant.import_config import ImportSpec, parse_quantization_config
from llmc.quant.importers import concat_out, unpack_module
from llmc.runtime.artifact import ModelConfig
from llmc.runtime.models.spec import ModelSpec


def import_spec(hf_config: dict, model_dir: Path) -> ImportSpec:
    config = hf_config.get("quantization_config")
    if not config:
        raise CheckpointError(f"{model_dir}: quantization.method import needs a quantized checkpoint, and "
                              "config.json has no quantization_config; use rtn, gptq, awq or fp8 instead")
    return parse_quantization_config(config)


def import_formats(hf_config: dict, spec: ModelSpec, config: ModelConfig, model_dir: Path) -> dict[str, dict]:
    """Format of every linear: the checkpoint's quantized format, dense where it left modules unquantized."""
    ispec = import_spec(hf_config, model_dir)
    dense = DenseFormat(getattr(torch, config.dtype)).spec()
    formats = {}
    for i in range(config.num_layers):
        for linear in spec.layer_linears:
            members = [f"{spec.hf_layer_prefix}{i}.{m}" for m in linear.hf_members]
            ignored = [ispec.is_ignored(m) for m in members]
            if any(ignored) and not all(ignored):
                raise CheckpointError(f"{model_dir}: {members} are fused into one linear but only some are quantized")
            formats[f"layers.{i}.{linear.name}"] = dense if all(ignored) else ispec.format_spec()
    if not config.tie_word_embeddings:
        formats["lm_head"] = dense
    return formats


class ImportPacker:
    """The LayerPacker of an import: unpack each member's tensors and fuse them (the writer shards and packs)."""

    def __init__(self, hf_config: dict, spec: ModelSpec, config: ModelConfig, formats: dict[str, dict], reader: TensorReader):
        self.ispec = import_spec(hf_config, reader.model_dir)
        self.spec = spec
        self.config = config
        self.formats = formats
        self.reader = reader
        self.dtype = getattr(torch, config.dtype)

    def read_layer(self, reader: TensorReader, spec: ModelSpec, config: ModelConfig, index: int) -> LayerWeights:
        quantized = {n.split(".", 2)[2] for n, f in self.formats.items() if n.startswith(f"layers.{index}.") and f["format"] != "dense"}
        return read_layer(reader, spec, config, index, skip_linears=quantized)

    def __call__(self, layer: LayerWeights) -> LayerWeights:
        linears = {}
        for linear in self.spec.layer_linears:
            fmt_spec = self.formats[f"layers.{layer.index}.{linear.name}"]
            if fmt_spec["format"] == "dense":
                linears[linear.name] = layer.linears[linear.name]
                continue
            members = [f"{self.spec.hf_layer_prefix}{layer.index}.{m}" for m in linear.hf_members]
            linears[linear.name] = concat_out([self._unpack(m) for m in members], members)
        return LayerWeights(layer.index, linears, layer.biases, layer.norms)

    def _unpack(self, module: str):
        prefix = module + "."
        tensors = {n[len(prefix):]: self.reader.get(n) for n in self.reader.names() if n.startswith(prefix)}
        in_features, out_features = self._shape(module)
        return unpack_module(self.ispec, module, tensors, in_features, out_features)

    def _shape(self, module: str) -> tuple[int, int]:
        c = self.config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        shapes = {"q_proj": (c.hidden_size, q), "k_proj": (c.hidden_size, kv), "v_proj": (c.hidden_size, kv),
                  "o_proj": (q, c.hidden_size), "gate_proj": (c.hidden_size, c.intermediate_size),
                  "up_proj": (c.hidden_size, c.intermediate_size), "down_proj": (c.intermediate_size, c.hidden_size)}
        return shapes[module.rsplit(".", 1)[1]]

    def pack_global(self, module: str, weight: Tensor) -> Tensor:
        return weight
