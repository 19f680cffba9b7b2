"""`quantization.method: import`: an AutoAWQ, GPTQ, compressed-tensors, FP8 or ModelOpt checkpoint, unpacked and
re-packed into llmc's formats. No re-quantization: the levels, scales and zeros are the checkpoint's.

Mixture-of-experts checkpoints are read as llm-compressor, GPTQModel and AutoAWQ write them: one module
per expert (`block_sparse_moe.experts.{e}.w1`, `mlp.experts.{e}.gate_proj`, ...), each unpacked like a
dense linear; each expert's gate and up fuse into its gate_up, and `pack_layer` stacks the experts. The
router stays dense: the checkpoint must hold it as a plain `.weight` (its `ignore` list names it).

An untied lm_head is imported in the format quantization_config gives it (GPTQ `lm_head: true`; compressed-tensors
targets that reach it and an `ignore` without it), unpacked like any linear and padded to the vocabulary rows
the ranks split; the runtime runs it as it runs a head quantized by a build from the float checkpoint.
A quantized head on a model with tie_word_embeddings, and a head whose tensors the config does not describe,
are refused by name.

GLM-4, GLM-4.5, Cohere and ERNIE 4.5 (hf_checkpoint.rotary_row_permutation): the build's reader permutes q_proj's and
k_proj's `.weight` rows per head as it reads them (the rotary folds, by name: FP8 levels too), and the packer moves
each row's FP8 scale with it: a per-tensor scale holds for every row, per-channel scales and block scales (unpacked
one per row, as w8a8-fp8-block stores them) are permuted alike, so the product is exact whatever the block size.
Other formats' packed weights do not take the permutation; compiler/build.py refuses them by name.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from torch import Tensor

from llmc.compiler.convert import LayerWeights, UnpackedLinear, read_global, read_layer
from llmc.compiler.hf_checkpoint import TensorReader, rotary_row_permutation
from llmc.compiler.quantize import module_names
from llmc.errors import CheckpointError
from llmc.quant.formats import DenseFormat, QuantizedWeight
from llmc.quant.import_config import ImportSpec, check_module_tensors, parse_quantization_config
from llmc.quant.importers import concat_out, unpack_module
from llmc.runtime.artifact import ModelConfig
from llmc.runtime.models.spec import ModelSpec, expert_linear_name, format_key, hf_member_rows, in_layer


# Where AutoGPTQ / GPTQModel and AutoAWQ keep the config when config.json has none (vLLM reads them too);
# the quant_method they imply when the file does not say.
# NVIDIA ModelOpt writes hf_quant_config.json ({"producer": ..., "quantization": {"quant_algo": ...}}).
SIDE_CONFIG_FILES = (("quantize_config.json", "gptq"), ("quant_config.json", "awq"),
                     ("hf_quant_config.json", "modelopt"))


def checkpoint_quantization_config(hf_config: dict, model_dir: Path) -> dict | None:
    """config.json's quantization_config, else the first side file's (with the quant_method it implies), else None."""
    config = hf_config.get("quantization_config")
    for name, method in SIDE_CONFIG_FILES:
        path = Path(model_dir) / name
        if not config and path.is_file():
            config = {"quant_method": method, **json.loads(path.read_text())}
    return config or None


def import_spec(hf_config: dict, model_dir: Path) -> ImportSpec:
    config = checkpoint_quantization_config(hf_config, model_dir)
    if not config:
        raise CheckpointError(f"{model_dir}: quantization.method import needs a quantized checkpoint, and "
                              "config.json has no quantization_config (and there is no quantize_config.json, "
                              "quant_config.json or hf_quant_config.json); use rtn, gptq, awq or fp8 instead")
    return parse_quantization_config(config)


def import_formats(hf_config: dict, spec: ModelSpec, config: ModelConfig, model_dir: Path) -> dict[str, dict]:
    """Format of every linear: the checkpoint's quantized format, dense where it left modules unquantized.
    An MoE layer's experts have one format per projection: all of them quantized, or all left dense."""
    ispec = import_spec(hf_config, model_dir)
    dense = DenseFormat(getattr(torch, config.dtype)).spec()
    formats = {}
    for module, names in module_names(spec, config).items():
        if module == "lm_head":  # (a tied head is the embedding: module_names leaves it out)
            formats[module] = dense if ispec.is_ignored(_head_module(spec)) else ispec.format_spec()
            continue
        members = names[1:]
        ignored = [m for m in members if ispec.is_ignored(m)]
        if ignored and len(ignored) != len(members):
            what = "experts" if ".moe.experts." in module else "members"
            raise CheckpointError(f"{model_dir}: {module} fuses {len(members)} checkpoint modules but quantization_config "
                                  f"leaves only some of them unquantized ({ignored[0]}, ...); llmc needs all its {what} "
                                  "quantized alike: re-export with all of them quantized or all ignored")
        formats[module] = dense if ignored else ispec.format_spec()
    return formats


class ImportPacker:
    """The LayerPacker of an import: unpack each member's tensors and fuse them (the writer shards and packs)."""

    def __init__(self, hf_config: dict, spec: ModelSpec, config: ModelConfig, formats: dict[str, dict], reader: TensorReader):
        self.ispec = import_spec(hf_config, reader.model_dir)
        self.spec = spec
        self.config = config
        self.formats = formats
        self.reader = reader
        self.module_tensors = tensors_by_module(reader.names())
        self.row_permutation = rotary_row_permutation(config)  # of each head's q/k rows, or None
        self._check_routers()
        self._check_head()
        self._check_dense_linears()

    def read_layer(self, reader: TensorReader, spec: ModelSpec, config: ModelConfig, index: int) -> LayerWeights:
        return read_layer(reader, spec, config, index, skip_linears=set(self._quantized_linears(index)))

    def __call__(self, layer: LayerWeights) -> LayerWeights:
        quantized = self._quantized_linears(layer.index)
        linears = {name: concat_out([self._unpack_member(*m) for m in members], [m[0] for m in members])
                   if name in quantized else layer.linears[name]
                   for name, members in self._all_linears(layer.index).items()}
        return LayerWeights(layer.index, linears, layer.biases, layer.norms)

    def read_global(self, reader: TensorReader, spec: ModelSpec, module: str, padded_vocab_size: int) -> UnpackedLinear:
        """A global module's weight: a quantized lm_head unpacked from the checkpoint's tensors (rows past the
        vocabulary added with weight 0, as `read_global` zero-pads a float head); the rest read as float."""
        if module != "lm_head" or self.formats["lm_head"]["format"] == "dense":
            return read_global(reader, spec, module, padded_vocab_size)
        q = self._unpack(_head_module(spec), self.config.hidden_size, self.config.vocab_size)
        return _pad_rows(q, padded_vocab_size)

    def pack_global(self, module: str, weight: UnpackedLinear) -> UnpackedLinear:
        return weight

    def _all_linears(self, index: int) -> dict[str, list[tuple[str, int, int]]]:
        """Every linear of layer `index` in runtime names (an MoE layer's: each expert's gate_up, then each
        down) → its HF member modules, each as (name, in_features, out_features)."""
        c, spec, prefix = self.config, self.spec, f"{self.spec.hf_layer_prefix}{index}."
        h = c.hidden_size
        inputs = {"attn.qkv": h, "attn.o": c.num_heads * c.head_dim, "mlp.gate_up": h, "mlp.down": c.intermediate_size,
                  "moe.shared.gate_up": h, "moe.shared.up": h, "moe.shared.down": c.shared_expert_intermediate_size}
        if c.linear_attention_layers:  # a Gated DeltaNet's (Qwen3.5: build.HYBRID_IMPORTS)
            inputs |= {"attn.in_qkvz": h, "attn.out": c.linear_num_value_heads * c.linear_value_head_dim}
        if c.mamba_layers:  # a Mamba-2 mixer's, and an MLP without gate (Nemotron-H: build.HYBRID_IMPORTS)
            inputs |= {"attn.mamba_in": h, "attn.mamba_out": c.mamba_num_heads * c.mamba_head_dim, "mlp.up": h}
        if c.is_mla:  # DeepSeek's attention (runtime/models/mla.py)
            inputs |= {"attn.q": h, "attn.q_a": h, "attn.q_b": c.q_lora_rank, "attn.kv_a": h,
                       "attn.kv_b": c.kv_lora_rank, "attn.o": c.num_heads * c.v_head_dim}
        linears = {}
        for linear in spec.layer_linears:
            if not in_layer(linear, c, index):
                continue
            # a member stored fused (Phi-3's qkv_proj) is unpacked whole: its rows are the runtime linear's
            linears[linear.name] = [(prefix + m, inputs[linear.name], rows)
                                    for m, rows in zip(linear.hf_members, hf_member_rows(linear, c))]
        if c.is_moe_layer(index):
            moe, size = spec.moe, c.moe_intermediate_size
            experts = [prefix + moe.expert_prefix.format(e) for e in range(c.num_experts)]
            gate_up = (moe.up,) if moe.gate is None else (moe.gate, moe.up)  # (Nemotron-H's experts: no gate)
            linears |= {expert_linear_name(e, "gate_up"): [(p + m, h, size) for m in gate_up]
                        for e, p in enumerate(experts)}
            linears |= {expert_linear_name(e, "down"): [(p + moe.down, size, h)] for e, p in enumerate(experts)}
        return linears

    def _quantized_linears(self, index: int) -> dict[str, list[tuple[str, int, int]]]:
        return {name: members for name, members in self._all_linears(index).items()
                if self.formats[f"layers.{index}.{format_key(name)}"]["format"] != "dense"}

    def _unpack_member(self, module: str, in_features: int, out_features: int) -> QuantizedWeight:
        """A layer member unpacked; q_proj's and k_proj's scales permuted with the rows the reader permuted."""
        q = self._unpack(module, in_features, out_features)
        if self.row_permutation is None or not module.endswith((".self_attn.q_proj", ".self_attn.k_proj")):
            return q
        return scales_with_rows(q, self.row_permutation, self.config.head_dim, module)

    def _unpack(self, module: str, in_features: int, out_features: int) -> QuantizedWeight:
        tensors = self.module_tensors.get(module)
        if not tensors:
            raise CheckpointError(
                f"{self.reader.model_dir}: the checkpoint has no tensors of {module}, which quantization_config says is "
                f"quantized; llmc imports one module per linear and per expert, as llm-compressor, GPTQModel and AutoAWQ "
                f"save them ({module}.weight_packed, .qweight, ...)")
        return unpack_module(self.ispec, module, {k: self.reader.get(n) for k, n in tensors.items()}, in_features, out_features)

    def _check_head(self) -> None:
        """The checkpoint's lm_head tensors are what quantization_config says of them; a quantized head needs
        its own matrix (untied); a quantized head's tensors pass check_module_tensors before any layer is read."""
        module = _head_module(self.spec)
        found = sorted(self.module_tensors.get(module, {}))
        is_fp8 = "weight" in found and self.reader.dtype_name(module + ".weight").startswith("F8")  # (no data read)
        stored = ", ".join(f"{module}.{t}" for t in found)
        if not (found and (found != ["weight"] or is_fp8)):  # dense, or not stored (tied)
            if "lm_head" in self.formats and self.formats["lm_head"]["format"] != "dense":
                raise CheckpointError(
                    f"{self.reader.model_dir}: quantization_config says {module} is quantized ({self.ispec.method}), but "
                    f"the checkpoint holds {stored or 'no tensors of it'} (dense): the config does not describe the "
                    "tensors; fix quantization_config (GPTQ lm_head: false, compressed-tensors: lm_head in ignore)")
            return
        if self.config.tie_word_embeddings:
            raise CheckpointError(
                f"{self.reader.model_dir}: the checkpoint's {module} is quantized ({stored}) but tie_word_embeddings is "
                "true, so llmc's head is the embedding's matrix, which stays dense: a quantized tied lm_head is not "
                "imported; re-export with lm_head dense (ignored), or untie the embeddings in config.json")
        if self.formats["lm_head"]["format"] == "dense":
            raise CheckpointError(
                f"{self.reader.model_dir}: the checkpoint's {module} is quantized ({stored}), but quantization_config "
                "leaves it dense (GPTQ lm_head: false; AutoAWQ, which never quantizes it; compressed-tensors with lm_head in "
                "ignore or outside the targets; quant_method fp8, whose lm_head llmc reads dense as vLLM and transformers "
                "do): the config does not describe the tensors")
        # the head is written after every layer: its shapes, dtypes and g_idx are checked now, not then
        tensors = {k: self.reader.get(n) for k, n in self.module_tensors[module].items()}
        check_module_tensors(self.ispec, module, tensors, self.config.hidden_size, self.config.vocab_size)

    def _check_dense_linears(self) -> None:
        """A linear quantization_config leaves dense must hold a float `.weight`: FP8 or int8 levels would be read as
        weights (a ModelOpt exclude_modules wildcard, say, that names more or fewer modules than the export left
        dense). Read from the files' headers, before any layer is written."""
        for index in range(self.config.num_layers):
            quantized = self._quantized_linears(index)
            for name, members in self._all_linears(index).items():
                for module, _, _ in members if name not in quantized else ():
                    weight = module + ".weight"
                    dtype = self.reader.dtype_name(weight) if self.reader.has(weight) else ""
                    scales = {"weight_scale", "weight_scale_inv"} & set(self.module_tensors.get(module, {}))
                    if dtype.startswith(("F8", "I8")) or scales:
                        raise CheckpointError(
                            f"{self.reader.model_dir}: {module} is quantized in the checkpoint ({weight} {dtype}) but "
                            f"quantization_config leaves it dense ({self.ispec.method} ignore / exclude_modules / "
                            "modules_to_not_convert): the config does not describe the tensors")

    def _check_routers(self) -> None:
        """An MoE router is never quantized: the checkpoint must hold it dense, as its plain `.weight` (DeepSeek-V3's
        also its float e_score_correction_bias; MiniMax-M2's beside the router, MoeSpec.score_bias)."""
        biased = self.config.router_scoring == "sigmoid" and self.spec.moe.score_bias is None
        expected = ["e_score_correction_bias", "weight"] if biased else ["weight"]
        for index in self.config.moe_layers:
            router = f"{self.spec.hf_layer_prefix}{index}.{self.spec.moe.router}"
            found = sorted(self.module_tensors.get(router, {}))
            if found != expected or self.reader.get(router + ".weight").dtype == torch.float8_e4m3fn:
                raise CheckpointError(
                    f"{self.reader.model_dir}: the router {router} has {found or 'no tensors'} instead of a dense "
                    "weight; llmc keeps MoE routers unquantized: re-export with the router in quantization_config's ignore")


def scales_with_rows(q: QuantizedWeight, permutation: Tensor, head_dim: int, module: str) -> QuantizedWeight:
    """FP8 `q`, whose weight rows the reader permuted per head by `permutation` ([head_dim]: the old row of each new
    row), with its per-row scales permuted alike (per-channel, or block scales unpacked one per row); a per-tensor
    scale holds for every row as it is. Other formats are refused: their packed levels were not permuted."""
    if q.qweight.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"{module}: only FP8 q/k weights take the rotary row permutation, not {q.qweight.dtype}")
    if q.scales.shape[0] != q.out_features:  # per tensor ([1, 1])
        return q
    rows = (torch.arange(q.out_features // head_dim)[:, None] * head_dim + permutation).flatten()
    return dataclasses.replace(q, scales=q.scales[rows])


def _head_module(spec: ModelSpec) -> str:
    """lm_head's module name in the checkpoint ("lm_head")."""
    return spec.global_tensors["lm_head.weight"].removesuffix(".weight")


def _pad_rows(q: QuantizedWeight, rows: int) -> QuantizedWeight:
    """q with output rows added up to `rows`, each of weight exactly 0 (levels at the zero point, scale 1;
    FP8: 0 times its scale), as the zero rows a float lm_head is padded with to split its vocabulary."""
    extra = rows - q.out_features
    if extra <= 0:
        return q
    is_fp8 = q.qweight.dtype == torch.float8_e4m3fn
    zero_level = 0 if is_fp8 else 2 ** (q.bits - 1)

    def padded(t: Tensor, value: float) -> Tensor:
        return torch.cat([t, torch.full((extra, *t.shape[1:]), value).to(t.dtype)])  # (no torch.full in FP8)

    is_per_row = q.scales.shape[0] == q.out_features  # a per-tensor FP8 scale covers the new rows too
    return QuantizedWeight(
        qweight=padded(q.qweight, zero_level), scales=padded(q.scales, 1.0) if is_per_row else q.scales,
        zeros=None if q.zeros is None else padded(q.zeros, zero_level), bits=q.bits, group_size=q.group_size,
        g_idx=q.g_idx, input_scale=q.input_scale)


def tensors_by_module(names) -> dict[str, dict[str, str]]:
    """{module: {tensor name after the module: full name}}, split at the last dot (one pass over the checkpoint)."""
    modules: dict[str, dict[str, str]] = {}
    for name in names:
        module, _, param = name.rpartition(".")
        modules.setdefault(module, {})[param] = name
    return modules
