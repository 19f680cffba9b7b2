"""gpt-oss's experts as the build reads them (runtime/models/gpt_oss.py): every expert of a layer is stored in
`mlp.experts.gate_up_proj` [E, hidden, 2 * width] (input-major, gate and up interleaved in its columns) and
`mlp.experts.down_proj` [E, width, hidden], each with a `{name}_bias` [E, out]. The published checkpoints hold the two
weights in MXFP4 instead (quantization_config quant_method mxfp4): `{name}_blocks` [E, out, in / 32, 16] uint8, two
E2M1 values a byte (the low nibble first), and `{name}_scales` [E, out, in / 32] uint8, each group of 32 inputs' E8M0
exponent (2^(scale - 127)): output-major, so a block row is one output's weights. The build reads expert e's gate, up
and down weights and biases under per-expert names (`expert_tensors`), dequantized to float32 where MXFP4 (exact: every
E2M1 value times a power of two is a float32), and then quantizes them as the recipe says, like any float checkpoint's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from llmc.errors import CheckpointError
from llmc.runtime.artifact import ModelConfig
from llmc.runtime.models.spec import ModelSpec

logger = logging.getLogger("llmc")

# E2M1's 16 values by their 4 bits (sign, 2 exponent bits, 1 mantissa bit): the OCP Microscaling spec's table
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_GROUP = 32  # inputs per E8M0 scale
MXFP4_KEYS = ("quant_method", "modules_to_not_convert")  # what an mxfp4 quantization_config may say


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [..., groups, 16] uint8 and scales [..., groups] uint8 → float32 [..., groups * 32]: value 2j of a
    group from byte j's low nibble, 2j + 1 from its high one, times 2^(scale - 127)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape or \
            blocks.shape[-1] != MXFP4_GROUP // 2:
        raise CheckpointError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} "
                              f"{scales.dtype}: expected uint8 [..., groups, 16] and uint8 [..., groups]")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    values = torch.stack((table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]), dim=-1).flatten(-2)
    return torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127).flatten(-2)


def check_quantization_config(config: dict | None, model_dir: Path) -> None:
    """A gpt-oss checkpoint's quantization_config: none (float experts) or quant_method mxfp4 (the published layout;
    the tensors say which experts are MXFP4: `_expert_weight`). Any other method, or an mxfp4 key the build does not
    read, is refused by name."""
    if not config:
        return
    method = str(config.get("quant_method", "")).lower()
    if method != "mxfp4":
        raise CheckpointError(f"{model_dir}: gpt-oss with quantization_config quant_method {config.get('quant_method')!r}"
                              " is not supported; its float checkpoint or the published MXFP4 one (quant_method mxfp4) "
                              "is")
    unknown = sorted(set(config) - set(MXFP4_KEYS))
    if unknown:
        raise CheckpointError(f"{model_dir}: quantization_config {unknown}: not read by llmc's MXFP4 reader (it takes "
                              f"{', '.join(MXFP4_KEYS)}); remove them or use the float checkpoint")


def say_dequantized(reader, method: str) -> None:
    """One line where the checkpoint holds MXFP4 experts (`*_blocks` tensors): the build dequantizes them as it
    reads them, then the recipe's method applies."""
    blocks = [name for name in reader.names() if name.endswith("_blocks")]
    if blocks:
        logger.info("gpt-oss: the checkpoint's MXFP4 experts (%d tensors) are dequantized as they are read (exactly, "
                    "to float32), then quantization.method %s applies", len(blocks), method)


_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def stored_dtype(reader, spec: ModelSpec) -> str:
    """The model dtype of a gpt-oss checkpoint whose config.json names none (the published ones: their `dtype: auto`
    would otherwise read as float32, twice their size): the embedding's stored dtype (bfloat16 there)."""
    name = reader.dtype_name(spec.global_tensors["embed.weight"])
    if name not in _SAFETENSORS_DTYPES:
        raise CheckpointError(f"{reader.model_dir}: the embedding is stored as {name}; set `dtype` in the recipe")
    return _SAFETENSORS_DTYPES[name]


def _expert_weight(reader, name: str, expert: int, rows: slice = slice(None)) -> torch.Tensor:
    """Expert `expert`'s weight of fused tensor `name`, output-major [out, in] float32, its output rows `rows` (gate
    the even ones of gate_up, up the odd ones): the MXFP4 blocks of those rows dequantized (each row's scales are its
    own, so only they are) where the checkpoint holds `{name}_blocks`, else the float tensor's slice transposed
    ([in, out] stored)."""
    if reader.has(f"{name}_blocks"):
        return dequantize_mxfp4(reader.get_index(f"{name}_blocks", expert)[rows],
                                reader.get_index(f"{name}_scales", expert)[rows])
    return reader.get_index(name, expert)[:, rows].float().t()


def expert_tensors(spec: ModelSpec, config: ModelConfig) -> dict[str, Callable]:
    """For gpt-oss (MoeSpec.fused_layout "gpt_oss"), a `TensorReader` derived tensor for each expert's gate, up and
    down weight and bias under its per-expert name, read as expert e's slice of the fused tensors (only that slice):
    gate the even outputs of gate_up, up the odd ones, down as it is. {} for the other families."""
    moe = spec.moe
    if moe is None or moe.fused_layout != "gpt_oss":
        return {}
    derived = {}
    for i in config.moe_layers:
        layer = f"{spec.hf_layer_prefix}{i}."
        gate_up, down = (f"{layer}{name}" for name in moe.fused)
        for e in range(config.num_experts):
            prefix = layer + moe.expert_prefix.format(e)
            derived |= {
                f"{prefix}{moe.gate}.weight": lambda r, n=gate_up, e=e: _expert_weight(r, n, e, slice(0, None, 2)),
                f"{prefix}{moe.up}.weight": lambda r, n=gate_up, e=e: _expert_weight(r, n, e, slice(1, None, 2)),
                f"{prefix}{moe.down}.weight": lambda r, n=down, e=e: _expert_weight(r, n, e),
                f"{prefix}{moe.gate}.bias": lambda r, n=gate_up, e=e: r.get_index(f"{n}_bias", e)[0::2],
                f"{prefix}{moe.up}.bias": lambda r, n=gate_up, e=e: r.get_index(f"{n}_bias", e)[1::2],
                f"{prefix}{moe.down}.bias": lambda r, n=down, e=e: r.get_index(f"{n}_bias", e),
            }
    return derived
