"""GLM-4.5's, DeepSeek-V3's and GLM-4.7-Flash's multi-token-prediction (MTP) layer kept in the artifact, for MTP
speculative decoding (runtime/mtp_head.py). GLM-4.7-Flash's is DeepSeek-V3's kind (an MLA + MoE decoder layer under
the same names), its MLP the MoE where the checkpoint's layer has a router.

NOTE (format): GLM-4.5 / 4.6 and DeepSeek-V3 / R1 ship `num_nextn_predict_layers` = 1 MTP layer as checkpoint layer
num_hidden_layers = N (the DeepSeek-V3 paper's MTP module; the published indexes' names): model.layers.N.{enorm,
hnorm}.weight [hidden], model.layers.N.eh_proj.weight [hidden, 2 * hidden], model.layers.N.shared_head.norm.weight
[hidden], optionally model.layers.N.shared_head.head.weight [vocab, hidden] and model.layers.N.embed_tokens.weight
[vocab, hidden] (absent: the model's lm_head and embedding, which they copy), and an ordinary decoder layer's tensors
under model.layers.N. (its MLP the MoE where N >= first_k_dense_replace, as transformers' Glm4MoeDecoderLayer /
DeepseekV3DecoderLayer decide; DeepSeek-V3's attention MLA: q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa,
kv_a_layernorm, kv_b_proj, o_proj).

The build writes art.MTP_WEIGHTS, dense in the model dtype whatever the recipe's quantization (one layer; an import's
FP8 layer is dequantized as it is read, `fp8_dequantizer`: DeepSeek-V3 / R1 publish theirs in block FP8; an integer
one is not built: compiler/build._plan_mtp): the decoder layer under the runtime's names
(`layers.N.attn.qkv.weight`, ...: read, fused and packed as the main layers are, its q/k rows permuted by
hf_checkpoint.rotary_fold; an MLA layer's linears as the main layers' too: kv_b whole, split into W_UK / W_UV
at load, the interleaved rope pairs taken apart at run time), then enorm.weight, hnorm.weight, eh_proj.weight,
shared_head.norm.weight and, where the checkpoint has them, shared_head.head.weight and embed.weight; the manifest's
`mtp` section (art.MtpSpec) records which. Only the first MTP layer is built (the one both ship)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from llmc.compiler.convert import pack_layer, read_layer
from llmc.compiler.emit import SafetensorsWriter
from llmc.compiler.hf_checkpoint import TensorReader, rotary_fold
from llmc.errors import CheckpointError
from llmc.runtime import artifact as art
from llmc.runtime.artifact import ModelConfig
from llmc.runtime.models.spec import ModelSpec, float32_norms
from llmc.runtime.mtp_head import mtp_model_config, mtp_module_formats

logger = logging.getLogger("llmc")

# the MTP module's own tensors: the artifact's name → the checkpoint's, under model.layers.N.
OWN_TENSORS = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
               "shared_head.norm.weight": "shared_head.norm.weight"}
OPTIONAL_TENSORS = {"shared_head.head.weight": "shared_head.head.weight", "embed.weight": "embed_tokens.weight"}
# the families whose MTP layer is built, by the name the build log gives them (DeepSeek-V2 ships none)
MTP_FAMILIES = {"glm4_moe": "GLM-4.5", "deepseek_v3": "DeepSeek-V3", "glm4_moe_lite": "GLM-4.7-Flash"}


def num_mtp_layers(hf_config: dict) -> int:
    """The checkpoint's MTP layers by its config (num_nextn_predict_layers, or transformers 5's num_mtp_layers)."""
    return int(hf_config.get("num_nextn_predict_layers") or hf_config.get("num_mtp_layers") or 0)


def checkpoint_mtp(reader: TensorReader, spec: ModelSpec, model: ModelConfig, hf_config: dict) -> art.MtpSpec | None:
    """The MtpSpec of a GLM-4.5 or DeepSeek-V3 checkpoint's first MTP layer, else None; the build log says which and
    why."""
    count, name = num_mtp_layers(hf_config), MTP_FAMILIES[spec.family]
    if not count:
        return None
    n = model.num_layers
    prefix = f"{spec.hf_layer_prefix}{n}."
    missing = [prefix + hf for hf in OWN_TENSORS.values() if not reader.has(prefix + hf)]
    if missing:
        logger.info("%s: config num_nextn_predict_layers is %d but the checkpoint has no %s: no MTP layer built, "
                    "no MTP speculative decoding", name, count, missing[0])
        return None
    if count > 1:
        logger.info("%s: %d MTP layers; the first (layer %d) is built, the others are not", name, count, n)
    mtp = art.MtpSpec(layer_index=n, is_moe=reader.has(f"{prefix}{spec.moe.router}.weight"),
                      has_head=reader.has(prefix + OPTIONAL_TENSORS["shared_head.head.weight"]),
                      has_embed=reader.has(prefix + OPTIONAL_TENSORS["embed.weight"]))
    logger.info("%s: the multi-token prediction layer (layer %d) is built into %s, dense in %s, for speculative "
                "method mtp%s", name, n, art.MTP_WEIGHTS, model.dtype,
                "" if mtp.has_head else " (its head: the model's lm_head)")
    return mtp


# an FP8 weight's scale, by the name each layout gives it: transformers' / DeepSeek-V3's block-FP8 dequantization
# factor; compressed-tensors', vLLM's and ModelOpt's scale (a product, too)
FP8_SCALES = ("weight_scale_inv", "weight_scale")


def fp8_scale_name(reader: TensorReader, name: str) -> str | None:
    """The checkpoint's scale tensor of FP8 weight `name` (a module's .weight), None where it has none."""
    module = name.removesuffix(".weight")
    return next((f"{module}.{scale}" for scale in FP8_SCALES if name.endswith(".weight") and
                 reader.has(f"{module}.{scale}")), None)


def dequantize_fp8(levels: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                   name: str = "weight") -> torch.Tensor:
    """levels x scale in float64 (exact: E4M3 times a float32): with `block` (rows, columns), one scale per block from
    row 0 and column 0, the last ones partial (the published block-FP8 rule, scale [ceil(out / rows), ceil(in /
    columns)]); without, one scale for the tensor or one per output row ([out] or [out, 1])."""
    w, s = levels.double(), scale.double()
    out, inputs = w.shape
    if block is not None:
        rows, columns = block
        if tuple(s.shape) != (-(-out // rows), -(-inputs // columns)):
            raise CheckpointError(f"{name}: scale of shape {tuple(s.shape)} for {tuple(w.shape)} weights in blocks of "
                                  f"{list(block)}: expected {[-(-out // rows), -(-inputs // columns)]}")
        return w * s.repeat_interleave(rows, 0)[:out].repeat_interleave(columns, 1)[:, :inputs]
    if s.numel() == 1:
        return w * s.reshape(())
    if s.numel() == out and s.dim() <= 2 and s.shape[0] == out:
        return w * s.reshape(out, 1)
    raise CheckpointError(f"{name}: scale of shape {tuple(s.shape)} for {tuple(w.shape)} weights: expected one for the "
                          f"tensor or one per output row")


def fp8_dequantizer(scales: TensorReader, block: tuple[int, int] | None):
    """A TensorReader merge that reads an FP8 weight as its float64 dequantization (dequantize_fp8; its scale read from
    `scales`); other tensors as they are."""
    def dequantize(name: str, tensor: torch.Tensor) -> torch.Tensor:
        scale = fp8_scale_name(scales, name) if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else None
        if scale is None:
            return tensor
        return dequantize_fp8(tensor, scales.get(scale), block, name)
    return dequantize


def write_mtp_weights(model_dir: Path, spec: ModelSpec, model: ModelConfig, mtp: art.MtpSpec, path: Path,
                      lora=None, fp8_block: tuple[int, int] | None = None) -> None:
    """The MTP layer's tensors (module NOTE) into `path`, read through an FP8 import's dequantization (`fp8_block`: the
    checkpoint's block size, None for per-tensor or per-channel scales), the recipe's LoRA merge (`lora`, where it has
    one) and the q/k row permutation of the main layers."""
    config = mtp_model_config(model, mtp)
    raw = TensorReader(model_dir)
    steps = [step for step in (fp8_dequantizer(raw, fp8_block), lora, rotary_fold(spec, config)) if step is not None]

    def merge(name, tensor):
        for step in steps:
            tensor = step(name, tensor)
        return tensor

    dtype = getattr(torch, model.dtype)
    n, prefix = mtp.layer_index, f"{spec.hf_layer_prefix}{mtp.layer_index}."
    with raw, TensorReader(model_dir, merge=merge) as reader:
        layer = read_layer(reader, spec, config, n)
        packed = pack_layer(layer, mtp_module_formats(config, mtp), dtype, float32_norms(config))
        tensors = {f"layers.{n}.{name}": tensor for name, tensor in packed.items()}
        own = dict(OWN_TENSORS) | {name: hf for name, hf in OPTIONAL_TENSORS.items()
                                   if (mtp.has_head if name.startswith("shared_head") else mtp.has_embed)}
        tensors |= {name: reader.get(prefix + hf).to(dtype) for name, hf in own.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = SafetensorsWriter(path, [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()],
                               metadata={"format": "pt"})
    for name, tensor in tensors.items():
        writer.write(name, tensor.contiguous())
    writer.close()
