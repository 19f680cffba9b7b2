"""Reading GGUF checkpoints (llama.cpp's format, which vLLM serves too) as a build input.

A `.gguf` file (or the first of a gguf-split set, `NAME-00001-of-0000N.gguf`) is read with gguf-py (`gguf`):
its metadata becomes the HF config the build reads (`hf_config`), its tensors are served by HF name through
`GGUFTensorReader`, which has `hf_checkpoint.TensorReader`'s interface, so the rest of the build does not know
where the weights came from. Facts of the layout, as llama.cpp's converter writes it and transformers' GGUF loader
reads it back:

- a tensor's GGUF shape lists the fastest dim first ([in, out] for a linear): the data is the [out, in] matrix;
- llama's q and k rows are permuted per head for llama.cpp's interleaved rotary: GGUF row (h, i, j) is HF row
  (h, j, i) for i < head_dim / 2, j in {0, 1} (k with the KV heads' count); qwen2's rows are not permuted;
- no `output.weight`: the embedding is tied;
- `rope_freqs.weight` ([head_dim / 2], llama): the divisor of each rotary frequency, how the converter keeps Llama 3's
  llama3 rope scaling (no metadata says it): held aside as `rope_freqs` (gguf_input.llama3_rope reads it).

Q8_0 and Q4_0 hold blocks of 32 inputs with one fp16 scale: Q8_0 w = d * q (q int8), Q4_0 w = d * (q - 8)
(q 0..15, byte k holds element k in its low nibble and k + 16 in its high one). They are llmc's symmetric w8a16 /
w4a16 with group 32 (levels q + 128 / q, the implicit zero 2**(bits-1)), exactly, whenever the scales are stored
in float16 or float32 (`quantized`). Every other quantized type is dequantized with gguf's own `dequantize`.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from llmc.compiler.hf_checkpoint import interleaved_rotary_permutation
from llmc.errors import CheckpointError
from llmc.quant.formats import QuantizedWeight

logger = logging.getLogger("llmc")

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}  # general.architecture → HF's
BLOCK = 32  # Q8_0's and Q4_0's inputs per scale
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
# GGUF tensor name (after `blk.N.`) → HF name (after `model.layers.N.`)
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                   "output.weight": "lm_head.weight"}


def is_gguf(model: str) -> bool:
    """A recipe's `model` names a GGUF file (by its suffix, as vLLM and transformers tell one)."""
    return str(model).lower().endswith(".gguf")


def gguf_stem(model: str) -> str:
    """The model's name without `.gguf` and a split's `-00001-of-0000N` (the default artifact name)."""
    name = Path(model).name
    match = _SPLIT.match(name)
    return match["stem"] if match else name[: -len(".gguf")]


def gguf_files(path: Path) -> list[Path]:
    """The file, or every file of a gguf-split set named by its first (`NAME-00001-of-0000N.gguf`)."""
    if not path.is_file():
        raise CheckpointError(f"model: {path} is not a file")
    match = _SPLIT.match(path.name)
    if match is None:
        return [path]
    if int(match["no"]) != 1:
        raise CheckpointError(f"model: {path.name} is split {int(match['no'])} of a gguf-split set; point model at the "
                              f"first, {match['stem']}-00001-of-{match['count']}.gguf")
    count = int(match["count"])
    files = [path.with_name(f"{match['stem']}-{i:05d}-of-{match['count']}.gguf") for i in range(1, count + 1)]
    if missing := [f.name for f in files if not f.is_file()]:
        raise CheckpointError(f"model: the gguf-split set {path.name} lacks {missing}")
    return files


class GGUFCheckpoint:
    """One GGUF checkpoint: its metadata, its tensors by HF name (dequantized, or Q8_0 / Q4_0 as levels)."""

    def __init__(self, path: Path):
        from gguf import GGUFReader

        self.path = Path(path)
        self.files = gguf_files(self.path)
        try:
            readers = [GGUFReader(str(f)) for f in self.files]
        except (ValueError, OSError) as e:  # gguf's own one-line reasons (bad magic, version, a truncated file)
            raise CheckpointError(f"model: {self.path} is not a readable GGUF file ({e})") from None
        self.fields = readers[0].fields  # (gguf-split writes the metadata in the first file)
        declared = self.field("split.count", 1)
        if declared != len(self.files):
            raise CheckpointError(f"model: {self.path.name} says split.count {declared}, and {len(self.files)} "
                                  "file(s) were found by its name; give the first file of the whole set")
        self.arch = self.field("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise CheckpointError(f"model: {self.path.name}: GGUF architecture {self.arch!r} is not supported; "
                                  f"supported: {', '.join(ARCHITECTURES)} (convert the HF checkpoint instead)")
        tensors = {t.name: t for reader in readers for t in reader.tensors}
        # llama.cpp's Llama 3 rope scaling: per-frequency divisors (compiler/gguf_input.py's llama3_rope reads them)
        freqs = tensors.pop("rope_freqs.weight", None)
        self.rope_freqs = None if freqs is None else torch.from_numpy(np.array(freqs.data, dtype=np.float64))
        self.num_layers = self._arch_field("block_count")
        self._gguf_names = self._hf_names(tensors)
        self.tensors = {hf: tensors[g] for hf, g in self._gguf_names.items()}
        self._check_types()
        self.config = self._hf_config()

    def field(self, key: str, default=None):
        """A metadata value (str, number, or list), or `default`."""
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def _arch_field(self, key: str, default=None):
        value = self.field(f"{self.arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"model: {self.path.name} has no {self.arch}.{key} in its metadata")
        return value

    def _hf_names(self, tensors: dict) -> dict[str, str]:
        """HF name → GGUF name of every tensor; a tensor llmc does not place is refused by name."""
        names, unknown = {}, []
        for name in tensors:
            match = re.match(r"^blk\.(\d+)\.(.+)$", name)
            if match and int(match[1]) < self.num_layers and match[2] in _LAYER_TENSORS:
                names[f"model.layers.{match[1]}.{_LAYER_TENSORS[match[2]]}"] = name
            elif name in _GLOBAL_TENSORS:
                names[_GLOBAL_TENSORS[name]] = name
            else:
                unknown.append(name)
        if unknown:
            raise CheckpointError(f"model: {self.path.name} holds tensor(s) llmc does not read for {self.arch}: "
                                  f"{unknown[:4]}; they are not supported")
        return names

    def _check_types(self) -> None:
        """Every tensor is a float type or one gguf dequantizes (tried on one zero block), before any work."""
        from gguf import GGML_QUANT_SIZES, dequantize

        readable = {"F32", "F16", "BF16"}
        for name, tensor in self.tensors.items():
            kind = tensor.tensor_type
            if kind.name in readable:
                continue
            try:
                dequantize(np.zeros((1, GGML_QUANT_SIZES[kind][1]), dtype=np.uint8), kind)
                readable.add(kind.name)
            except (NotImplementedError, KeyError, ValueError):
                raise CheckpointError(f"model: {self.path.name}: tensor {self._gguf_names[name]} has type {kind.name}, "
                                      "which is not a weight type llmc reads (F32, F16, BF16, or a quantized type "
                                      "gguf dequantizes)") from None

    def _hf_config(self) -> dict:
        """config.json's keys from the metadata (transformers' GGUF config mapping, and llama.cpp's defaults)."""
        heads = self._arch_field("attention.head_count")
        kv_heads = self._arch_field("attention.head_count_kv", heads)
        hidden = self._arch_field("embedding_length")
        if isinstance(heads, list) or isinstance(kv_heads, list):
            raise CheckpointError(f"model: {self.path.name}: per-layer head counts are not supported")
        head_dim = self._arch_field("attention.key_length", hidden // heads)
        if self._arch_field("attention.value_length", head_dim) != head_dim:
            raise CheckpointError(f"model: {self.path.name}: attention.key_length and value_length differ; "
                                  "not supported")
        if self._arch_field("rope.dimension_count", head_dim) != head_dim:
            raise CheckpointError(f"model: {self.path.name}: rope.dimension_count "
                                  f"{self._arch_field('rope.dimension_count')} is not head_dim {head_dim}; a partial "
                                  "rotary is not supported for GGUF's llama and qwen2")
        if self.field(f"{self.arch}.expert_count", 0):
            raise CheckpointError(f"model: {self.path.name}: mixture-of-experts GGUF ({self.arch}.expert_count) is not "
                                  "supported")
        if "model.embed_tokens.weight" not in self.tensors:
            raise CheckpointError(f"model: {self.path.name} has no token_embd.weight; the file is incomplete")
        embed = self.tensors["model.embed_tokens.weight"]
        eos = [self.field(f"tokenizer.ggml.{key}") for key in ("eos_token_id", "eot_token_id")]
        config = {
            "architectures": [ARCHITECTURES[self.arch]], "model_type": self.arch,
            "vocab_size": int(embed.shape[1]), "hidden_size": hidden,
            "intermediate_size": self._arch_field("feed_forward_length"), "num_hidden_layers": self.num_layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "rms_norm_eps": self._arch_field("attention.layer_norm_rms_epsilon"),
            "rope_theta": float(self._arch_field("rope.freq_base", 10000.0)),
            "max_position_embeddings": self._arch_field("context_length"),
            "tie_word_embeddings": "lm_head.weight" not in self.tensors,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": list(dict.fromkeys(e for e in eos if e is not None)) or None,
            "torch_dtype": self.auto_dtype(),
        }
        scaling = self.field(f"{self.arch}.rope.scaling.type", "none")
        if scaling == "linear":
            config["rope_scaling"] = {"rope_type": "linear", "factor": float(self._arch_field("rope.scaling.factor"))}
        elif scaling != "none":
            raise CheckpointError(f"model: {self.path.name}: rope.scaling.type {scaling!r} is not supported for "
                                  "GGUF (none and linear are)")
        if self.arch == "llama" and any(n.endswith("_proj.bias") for n in self.tensors):
            raise CheckpointError(f"model: {self.path.name}: llama with attention biases is not supported")
        return config

    def auto_dtype(self) -> str:
        """The build's dtype for `dtype: auto`: the embedding's float type (F32, F16, BF16), else float16, which holds
        Q8_0's and Q4_0's fp16 scales exactly (vLLM's GGUF default too)."""
        name = self.type_name("model.embed_tokens.weight")
        return {"F32": "float32", "BF16": "bfloat16"}.get(name, "float16")

    def has(self, name: str) -> bool:
        return name in self.tensors

    def type_name(self, name: str) -> str:
        """The tensor's GGML type ("Q4_0", "F16", ...)."""
        return self.tensors[name].tensor_type.name

    def shape(self, name: str) -> tuple[int, ...]:
        """The HF shape ([out, in] for a linear): GGUF lists the fastest dim first."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def get(self, name: str) -> torch.Tensor:
        """The tensor in HF layout: F32 / F16 / BF16 as stored, a quantized type dequantized by gguf to float32."""
        from gguf import dequantize

        tensor = self.tensors[name]
        array = dequantize(tensor.data, tensor.tensor_type)  # (every type checked in _check_types)
        values = torch.from_numpy(np.array(array).reshape(self.shape(name)))  # (a copy: the file is mapped read-only)
        native = {"F16": torch.float16, "BF16": torch.bfloat16}.get(tensor.tensor_type.name)
        return self._unpermute(name, values if native is None else values.to(native))

    def quantized(self, name: str) -> QuantizedWeight:
        """A Q8_0 or Q4_0 linear's levels and scales, as stored (group 32, symmetric), its rows in HF order."""
        kind = self.type_name(name)
        out_features, in_features = self.shape(name)
        bits = {"Q8_0": 8, "Q4_0": 4}[kind]
        block_bytes = 2 + BLOCK * bits // 8
        raw = np.asarray(self.tensors[name].data).reshape(out_features, in_features // BLOCK, block_bytes)
        scales = np.ascontiguousarray(raw[..., :2]).view(np.float16)[..., 0].astype(np.float32)
        stored = np.ascontiguousarray(raw[..., 2:])
        if bits == 8:
            levels = stored.view(np.int8).astype(np.int32) + 128
        else:
            levels = np.concatenate([stored & 0x0F, stored >> 4], axis=-1).astype(np.int32)
        q = QuantizedWeight(qweight=torch.from_numpy(levels.reshape(out_features, in_features)),
                            scales=torch.from_numpy(scales), zeros=None, bits=bits, group_size=BLOCK)
        perm = self._row_order(name)
        if perm is None:
            return q
        return QuantizedWeight(qweight=q.qweight[perm].contiguous(), scales=q.scales[perm].contiguous(), zeros=None,
                               bits=bits, group_size=BLOCK)

    def _row_order(self, name: str) -> torch.Tensor | None:
        """The GGUF row of each HF row of a llama q / k (weight or bias): undoes llama.cpp's rotary permutation."""
        if self.arch != "llama" or not name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            return None
        heads = self.config["num_attention_heads"] if ".q_proj." in name else self.config["num_key_value_heads"]
        head_dim = self.config["head_dim"]
        # (interleaved pairs to rotate-half over the whole head: GLM-4's and Cohere's fold, per head)
        return (torch.arange(heads)[:, None] * head_dim + interleaved_rotary_permutation(head_dim, head_dim)).flatten()

    def _unpermute(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        perm = self._row_order(name)
        return tensor if perm is None else tensor[perm].contiguous()

    def type_counts(self, names) -> Counter:
        """{GGML type name: count} of the named tensors."""
        return Counter(self.type_name(n) for n in names)

    def source_files(self) -> list[Path]:
        return list(self.files)


class GGUFTensorReader:
    """`hf_checkpoint.TensorReader`'s interface over a GGUF checkpoint (tensors by HF name, dequantized)."""

    def __init__(self, checkpoint: GGUFCheckpoint, model_dir: Path, merge=None, derived: dict | None = None):
        self.checkpoint = checkpoint
        self.model_dir = model_dir  # the staged config and tokenizer (build._stage_gguf)
        self.merge = merge
        self.derived = derived or {}
        self.vision_names: dict[str, str] = {}

    def __enter__(self) -> GGUFTensorReader:
        return self

    def __exit__(self, *exc) -> None:
        pass

    def release(self) -> None:
        """Nothing to close: gguf maps the files read-only and the build's tensors are copies."""

    def names(self) -> list[str]:
        return list(self.checkpoint.tensors)

    def has(self, name: str) -> bool:
        return self.checkpoint.has(name) or name in self.derived

    def get(self, name: str) -> torch.Tensor:
        if name in self.derived:
            return self.derived[name](self)
        if not self.checkpoint.has(name):
            raise CheckpointError(f"{self.checkpoint.path}: tensor {name!r} is missing from the checkpoint")
        tensor = self.checkpoint.get(name)
        return tensor if self.merge is None else self.merge(name, tensor)

    def shape(self, name: str) -> tuple[int, ...]:
        if not self.checkpoint.has(name):
            raise CheckpointError(f"{self.checkpoint.path}: tensor {name!r} is missing from the checkpoint")
        return self.checkpoint.shape(name)

    def dtype_name(self, name: str) -> str:
        """The GGML type name ("F16", "Q4_0", ...) where safetensors would give its dtype."""
        return self.checkpoint.type_name(name)

    def source_files(self) -> list[Path]:
        return self.checkpoint.source_files()
