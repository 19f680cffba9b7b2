"""HF tensors → runtime tensors: rename, fuse (q,k,v → qkv; gate,up → gate_up), cast, pack.

The runtime's own module, built on the meta device, is the list of what the artifact must hold
(names, shapes, dtypes): the compiler writes exactly that, in that order, one layer at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from llmc.compiler.hf_checkpoint import TensorReader
from llmc.quant.formats import DenseFormat, make_format
from llmc.runtime.artifact import ModelConfig
from llmc.runtime.models.decoder import DecoderModel
from llmc.runtime.models.spec import ModelSpec


@dataclass
class LayerWeights:
    """One decoder layer in runtime names, unfused-free: linears already concatenated, float tensors."""

    index: int
    linears: dict[str, Tensor]  # "attn.qkv" → [out_features, in_features]
    biases: dict[str, Tensor]  # "attn.qkv" → [out_features], only where the model has biases
    norms: dict[str, Tensor]  # "input_norm" → [hidden_size]


# Packs one layer: LayerWeights → {runtime tensor name inside the layer: packed tensor}.
LayerPacker = Callable[[LayerWeights], dict[str, Tensor]]


def artifact_tensor_specs(config: ModelConfig, module_formats: dict[str, dict]) -> list[tuple[str, torch.dtype, tuple]]:
    """(name, dtype, shape) of every tensor the runtime will load, in the runtime module's order."""
    model = meta_model(config, module_formats)
    return [(name, t.dtype, tuple(t.shape)) for name, t in model.state_dict().items()]


def meta_model(config: ModelConfig, module_formats: dict[str, dict]) -> DecoderModel:
    dtype = getattr(torch, config.dtype)
    formats = {name: make_format(spec, dtype) for name, spec in module_formats.items()}
    with torch.device("meta"):
        return DecoderModel(config, formats, max_positions=1)


def read_layer(reader: TensorReader, spec: ModelSpec, config: ModelConfig, index: int,
               skip_linears: set[str] = frozenset()) -> LayerWeights:
    """One layer's float tensors in runtime names; `skip_linears` are not read (imported quantized ones)."""
    prefix = f"{spec.hf_layer_prefix}{index}."
    linears, biases = {}, {}
    for linear in spec.layer_linears:
        members = [prefix + member for member in linear.hf_members]
        if linear.name not in skip_linears:
            linears[linear.name] = torch.cat([reader.get(m + ".weight").float() for m in members])
        if config.attention_bias and linear.name == "attn.qkv":
            biases[linear.name] = torch.cat([reader.get(m + ".bias").float() for m in members])
    norm_names = {**spec.layer_norms, **(spec.qk_norms if config.qk_norm else {})}
    norms = {name: reader.get(f"{prefix}{hf}.weight").float() for name, hf in norm_names.items()}
    return LayerWeights(index, linears, biases, norms)


def dense_packer(config: ModelConfig, module_formats: dict[str, dict]) -> LayerPacker:
    """The packer of an unquantized build: every linear in the dense format."""
    dtype = getattr(torch, config.dtype)

    def pack(layer: LayerWeights) -> dict[str, Tensor]:
        return pack_layer(layer, {name: DenseFormat(dtype).pack_dense(w) for name, w in layer.linears.items()}, dtype)

    return pack


def pack_layer(layer: LayerWeights, packed_linears: dict[str, dict[str, Tensor]], dtype: torch.dtype) -> dict[str, Tensor]:
    """Assemble a layer's runtime tensors from its packed linears, biases and norms."""
    out = {}
    for name, params in packed_linears.items():
        for param, tensor in params.items():
            out[f"{name}.{param}"] = tensor
    for name, bias in layer.biases.items():
        out[f"{name}.bias"] = bias.to(dtype)
    for name, weight in layer.norms.items():
        out[f"{name}.weight"] = weight.to(dtype)
    return out


def iter_artifact_tensors(
    reader: TensorReader,
    spec: ModelSpec,
    config: ModelConfig,
    specs: list[tuple[str, torch.dtype, tuple]],
    pack_layer_fn: LayerPacker,
    pack_global_fn: Callable[[str, Tensor], dict[str, Tensor]],
) -> Iterator[tuple[str, Tensor]]:
    """Yield (name, tensor) in the order of `specs`, producing one decoder layer at a time."""
    pending: dict[str, Tensor] = {}
    for name, _, _ in specs:
        if name not in pending:
            if name.startswith("layers."):
                index = int(name.split(".")[1])
                read = getattr(pack_layer_fn, "read_layer", read_layer)
                layer = pack_layer_fn(read(reader, spec, config, index))
                pending.update({f"layers.{index}.{k}": v for k, v in layer.items()})
            else:
                pending.update(read_global(reader, spec, name, pack_global_fn))
        yield name, pending.pop(name)
    if pending:
        raise RuntimeError(f"produced tensors the runtime does not load: {sorted(pending)[:5]}")


def read_global(reader: TensorReader, spec: ModelSpec, name: str, pack_global_fn) -> dict[str, Tensor]:
    module = name.rsplit(".", 1)[0]  # "lm_head", "embed", "norm"
    hf_name = spec.global_tensors[f"{module}.weight"]
    return {f"{module}.{k}": v for k, v in pack_global_fn(module, reader.get(hf_name).float()).items()}
