"""A GGUF checkpoint as the build's input (compiler/gguf_checkpoint.py reads it): its tokenizer staged as HF files,
the formats of `quantization.method: import`, the import's packer, and the line naming what is dequantized.

`method: import` keeps Q8_0 and Q4_0 linears as stored (w8a16 / w4a16, symmetric, group 32) and F32 / F16 / BF16
ones dense; the embedding and an untied output head are llmc's dense modules whatever their type. Any other type
in a decoder linear (the k-quants, Q4_1, Q5_0, the i-quants, ...) has no exact llmc format and is refused by name,
as is a fused q/k/v or gate/up whose members differ in type (one format per runtime linear), and a dtype whose
scales would round the fp16 ones (bfloat16). Every other method dequantizes the file's quantized tensors with
gguf's own `dequantize` and quantizes the float weights as it would an HF checkpoint's.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path

import torch

from llmc.compiler.convert import LayerWeights, read_layer
from llmc.compiler.gguf_checkpoint import GGUFCheckpoint, GGUFTensorReader
from llmc.compiler.import_quantized import ImportPacker
from llmc.compiler.quantize import module_names
from llmc.errors import CheckpointError, RecipeError
from llmc.quant.formats import DenseFormat, IntWeightFormat, QuantizedWeight
from llmc.runtime.artifact import ModelConfig
from llmc.runtime.layers.rotary import inv_frequencies
from llmc.runtime.models.spec import ModelSpec

logger = logging.getLogger("llmc")

FLOAT_TYPES = ("F32", "F16", "BF16")
# Llama 3's published rope scalings (3.1 and 3.3; 3.2's 1B and 3B), which a GGUF keeps only as rope_freqs.weight
LLAMA3_SCALINGS = tuple({"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192} for factor in (8.0, 32.0))
EXACT_TYPES = {"Q8_0": 8, "Q4_0": 4}  # GGML type → llmc's integer bits (group 32, symmetric)


def stage_tokenizer(checkpoint: GGUFCheckpoint, tokenizer: str | None, dest: Path, names: tuple[str, ...]) -> None:
    """The tokenizer's HF files into `dest`: copied from the recipe's `tokenizer` directory (vLLM's --tokenizer), else
    made by transformers from the GGUF's own tokenizer metadata (`from_pretrained(..., gguf_file=...)`)."""
    if tokenizer is not None:
        found = [name for name in names if (Path(tokenizer) / name).is_file()]
        if not {"tokenizer.json", "tokenizer.model", "vocab.json"} & set(found):
            raise CheckpointError(f"tokenizer: {tokenizer} has no tokenizer files (tokenizer.json, tokenizer.model or "
                                  "vocab.json); give an HF tokenizer's directory")
        for name in found:
            shutil.copy2(Path(tokenizer) / name, dest / name)
        return
    from transformers import AutoTokenizer

    if checkpoint.field("tokenizer.ggml.model") is None:
        raise CheckpointError(f"model: {checkpoint.path.name} holds no tokenizer (no tokenizer.ggml.model); set "
                              "the recipe's tokenizer to the model's HF tokenizer directory")
    try:
        hf_tokenizer = AutoTokenizer.from_pretrained(str(checkpoint.path.parent), gguf_file=checkpoint.path.name)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise CheckpointError(f"model: transformers cannot build a tokenizer from {checkpoint.path.name}'s metadata "
                              f"({type(e).__name__}: {e}); set the recipe's tokenizer to an HF tokenizer "
                              "directory") from None
    hf_tokenizer.save_pretrained(str(dest))


def llama3_rope(checkpoint: GGUFCheckpoint, model: ModelConfig) -> ModelConfig:
    """The model with the rope scaling llama.cpp's `rope_freqs.weight` encodes (per-frequency divisors: its converter
    writes Llama 3's llama3 scaling so, with no metadata): the config's own (the recipe's hf_overrides.rope_scaling)
    if it gives those divisors, else the published Llama 3 scaling that does (said in one line); refused by name if
    none does."""
    if checkpoint.rope_freqs is None:
        return model
    plain = inv_frequencies(model.head_dim, model.rope_theta, None)
    candidates = [model.rope_scaling] if model.rope_scaling else list(LLAMA3_SCALINGS)
    for scaling in candidates:
        divisors = plain / inv_frequencies(model.head_dim, model.rope_theta, scaling)
        if divisors.shape == checkpoint.rope_freqs.shape and torch.allclose(divisors, checkpoint.rope_freqs, rtol=1e-6):
            if not model.rope_scaling:
                logger.info("%s: rope_freqs.weight is Llama 3's rope scaling %s", checkpoint.path.name, scaling)
            return dataclasses.replace(model, rope_scaling=scaling)
    what = "the config's rope_scaling" if model.rope_scaling else "a published Llama 3 rope scaling (factor 8 or 32)"
    raise CheckpointError(f"model: {checkpoint.path.name}: rope_freqs.weight (llama.cpp's rope frequency divisors) is "
                          f"not {what}; set hf_overrides.rope_scaling to the model's config.json rope_scaling, which "
                          "the build checks against them")


def dequantized_types(checkpoint: GGUFCheckpoint, kept: set[str]) -> dict[str, int]:
    """{GGML type: tensors} of the quantized tensors the build dequantizes (all but `kept`, the ones imported)."""
    counts = checkpoint.type_counts(n for n in checkpoint.tensors if n not in kept)
    return {kind: n for kind, n in sorted(counts.items()) if kind not in FLOAT_TYPES}


def say_dequantized(checkpoint: GGUFCheckpoint, kept: set[str], dtype: str, method: str) -> None:
    """One line naming the types dequantized to the compute dtype, and what then happens to them."""
    types = dequantized_types(checkpoint, kept)
    if not types:
        return
    then = {"none": "kept dense", "import": "kept dense (the embedding and output head)"}.get(
        method, f"then quantization.method {method} applies as to float weights")
    logger.info("%s: dequantizing %s with gguf to %s, %s", checkpoint.path.name,
                ", ".join(f"{kind} ({n} tensors)" for kind, n in types.items()), dtype, then)


def gguf_import_formats(checkpoint: GGUFCheckpoint, spec: ModelSpec, config: ModelConfig) -> dict[str, dict]:
    """Format of every linear under method import: the stored type's exact llmc format, refused where none is."""
    dtype = getattr(torch, config.dtype)
    if dtype == torch.bfloat16 and any(checkpoint.type_name(n) in EXACT_TYPES for n in checkpoint.tensors):
        raise RecipeError("dtype: bfloat16 would round Q8_0's and Q4_0's fp16 scales (the artifact stores them in the "
                          "model dtype); use dtype float16 (auto) or float32 with quantization.method import")
    formats = {}
    for module, names in module_names(spec, config).items():
        if module == "lm_head":  # llmc's output head stays dense in a GGUF import (dequantized: say_dequantized)
            formats[module] = DenseFormat(dtype).spec()
            continue
        members = [f"{m}.weight" for m in names[1:]]
        inexact = [(m, checkpoint.type_name(m)) for m in members
                   if checkpoint.type_name(m) not in (*EXACT_TYPES, *FLOAT_TYPES)]
        if inexact:
            raise CheckpointError(f"quantization.method import: {inexact[0][0]} is GGUF {inexact[0][1]}, which no llmc "
                                  "format holds exactly (import keeps Q8_0 and Q4_0 as stored); use method none, rtn, "
                                  "gptq, awq or fp8, which dequantize it first")
        types = sorted({checkpoint.type_name(m) for m in members})
        if len(types) > 1 and not set(types) <= set(FLOAT_TYPES):
            raise CheckpointError(f"quantization.method import: {module} fuses {', '.join(members)} of different "
                                  f"GGUF types {types}; llmc needs one format per runtime linear: use method rtn, "
                                  "gptq, awq or fp8 (which dequantize), or none")
        if types[0] in EXACT_TYPES:
            formats[module] = IntWeightFormat(dtype, bits=EXACT_TYPES[types[0]], group_size=32, symmetric=True).spec()
        else:
            formats[module] = DenseFormat(dtype).spec()
    return formats


def imported_tensors(checkpoint: GGUFCheckpoint) -> set[str]:
    """The tensors an import keeps as stored: the decoder linears of Q8_0 and Q4_0."""
    return {n for n in checkpoint.tensors if n.startswith("model.layers.") and checkpoint.type_name(n) in EXACT_TYPES}


class GGUFImportPacker(ImportPacker):
    """ImportPacker over a GGUF checkpoint: each quantized member is the stored Q8_0 / Q4_0 levels and scales
    (GGUFCheckpoint.quantized), fused and packed as any import's; the rest is read dense."""

    def __init__(self, spec: ModelSpec, config: ModelConfig, formats: dict[str, dict], reader: GGUFTensorReader):
        self.spec, self.config, self.formats, self.reader = spec, config, formats, reader
        self.checkpoint = reader.checkpoint
        self.row_permutation = None  # (the families whose q/k rows the build permutes refuse GGUF inputs: build.py)

    def read_layer(self, reader, spec: ModelSpec, config: ModelConfig, index: int) -> LayerWeights:
        return read_layer(reader, spec, config, index, skip_linears=set(self._quantized_linears(index)))

    def _unpack(self, module: str, in_features: int, out_features: int) -> QuantizedWeight:
        q = self.checkpoint.quantized(module + ".weight")
        if q.qweight.shape != (out_features, in_features):
            raise CheckpointError(f"{self.checkpoint.path.name}: {module} is {tuple(q.qweight.shape)}, the config "
                                  f"says ({out_features}, {in_features})")
        return q  # (LoRA adapters with method import are refused by lora.load_adapters)
