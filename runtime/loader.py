"""Loading an artifact's weights into the runtime module: strict names, shapes and dtypes."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Mapping

import torch
from safetensors import SafetensorError, safe_open

from llmc.errors import ArtifactError, LlmcError
from llmc.kernels.w4a16_gemm import DEFAULT_W4A16_TABLE_GPU, parse_w4a16_table
from llmc.quant.formats import IntWeightFormat, LinearFormat, make_format
from llmc.runtime import artifact as art
from llmc.runtime.layers.rotary import check_rotary_device
from llmc.runtime.models.decoder import DecoderModel
from llmc.runtime.parallel.layout import RankLayout

logger = logging.getLogger("llmc")


def compute_dtype(manifest: art.Manifest, device: torch.device) -> torch.dtype:
    """The artifact's dtype on GPUs; float32 on CPUs, whose bfloat16/float16 matmuls are many times slower."""
    return torch.float32 if device.type == "cpu" else getattr(torch, manifest.model.dtype)


def build_model(artifact_dir: Path, manifest: art.Manifest, device: torch.device, max_positions: int,
                layout: RankLayout | None = None, tp_group=None, keep_gate_up_order: bool = False) -> DecoderModel:
    """Create the module on the meta device, then fill every buffer from the rank's weights file
    (rank 0, the whole model, without a layout).

    Floating tensors stored in the artifact's dtype are cast to the compute dtype as they load.
    """
    rel = art.rank_weights_path(layout.rank if layout is not None else 0)
    art.verify_for_load(artifact_dir, manifest, [rel])  # before anything is built from it
    check_rotary_device(manifest.model, device)  # (the engine checks first: this covers every rank's load)
    dtype = compute_dtype(manifest, device)
    config = dataclasses.replace(manifest.model, dtype=str(dtype).removeprefix("torch."))
    formats = make_formats(manifest, dtype)
    if device.type == "cuda" and any(_is_w4a16_gpu(fmt) for fmt in formats.values()):
        log_kernel_table(manifest, device)
    try:
        with torch.device("meta"):
            model = DecoderModel(config, formats, max_positions, layout, tp_group)
    except KeyError as e:  # a linear the manifest gives no format
        raise ArtifactError(f"manifest.json: quant.modules has no format for {e.args[0]!r}; rebuild the artifact") from None
    model.cos_sin, model.cos_sin_local, model.cos_sin_none = _rope_tables(manifest, max_positions, device)
    load_weights(model, artifact_dir / rel, device, stored_dtype=getattr(torch, manifest.model.dtype))
    model.prepare_loaded_weights(keep_gate_up_order)
    return model.eval()


def make_formats(manifest: art.Manifest, dtype: torch.dtype) -> dict[str, LinearFormat]:
    """Runtime module name → its format; w4a16 linears in the gpu layout carry the plan's kernel table."""
    table = kernel_table(manifest)
    formats = {}
    for name, spec in manifest.quant.modules.items():
        try:
            fmt = make_format(spec, dtype)
        except (KeyError, TypeError, ValueError, LlmcError) as e:
            raise ArtifactError(f"manifest.json: quant.modules[{name!r}] is not a format this llmc loads "
                                f"({e}); rebuild the artifact") from None
        formats[name] = dataclasses.replace(fmt, kernel_table=table) if _is_w4a16_gpu(fmt) else fmt
    return formats


def _is_w4a16_gpu(fmt: LinearFormat) -> bool:
    return isinstance(fmt, IntWeightFormat) and fmt.is_gpu_layout


def kernel_table(manifest: art.Manifest) -> Mapping | None:
    """The plan's W4A16 kernel table in the kernels' lookup form; None when the manifest records none."""
    records = manifest.plan.w4a16_kernels
    if not records:
        return None
    try:
        return parse_w4a16_table({shape: record["entries"] for shape, record in records.items()})
    except (KeyError, TypeError, ValueError) as e:
        raise ArtifactError(f"manifest.json: plan.w4a16_kernels is malformed ({e}); rebuild the artifact") from None


def log_kernel_table(manifest: art.Manifest, device: torch.device) -> None:
    """Say once per load which table picks the W4A16 kernels, and whether it was measured on another GPU."""
    records = manifest.plan.w4a16_kernels
    if not records:
        logger.info("w4a16 kernels: the artifact records no kernel table (built before llmc recorded one); "
                    "using the built-in table measured on %s, and a heuristic for other shapes", DEFAULT_W4A16_TABLE_GPU)
        return
    sources = sorted({art.kernel_source_label(record) for record in records.values()})
    logger.info("w4a16 kernels: the artifact's table for %d shape(s) (%s)", len(records), ", ".join(sources))
    gpu = torch.cuda.get_device_name(device)
    other = sorted({record["gpu"] for record in records.values() if record.get("gpu") and record["gpu"] != gpu})
    if other:
        logger.info("w4a16 kernels: entries measured on %s, this GPU is %s; using them as planned "
                    "(rebuild with target.tune_kernels: true on this GPU to measure it here)", ", ".join(other), gpu)


def _rope_tables(manifest: art.Manifest, max_positions: int, device: torch.device):
    """(the global rotary table, the sliding layers' own or None, the NoPE layers' or None) on `device`
    (decoder.rope_tables, decoder.nope_table)."""
    from llmc.runtime.models.decoder import nope_table, rope_tables

    tables = (*rope_tables(manifest.model, max_positions), nope_table(manifest.model, max_positions))
    return tuple(None if table is None else table.to(device) for table in tables)


def load_weights(model: torch.nn.Module, path: Path, device: torch.device, stored_dtype: torch.dtype) -> None:
    expected = {name: t for name, t in model.state_dict().items()}
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            names = set(f.keys())
            _check_names(path, names, set(expected))
            for name, meta in expected.items():
                tensor = f.get_tensor(name)
                if tensor.dtype == stored_dtype and meta.dtype.is_floating_point and meta.dtype.itemsize > 1:
                    tensor = tensor.to(meta.dtype)
                if tensor.shape != meta.shape or tensor.dtype != meta.dtype:
                    raise ArtifactError(
                        f"{path}: tensor {name} is {tensor.dtype} {tuple(tensor.shape)}, "
                        f"the model needs {meta.dtype} {tuple(meta.shape)}; rebuild the artifact"
                    )
                _assign(model, name, tensor)
    except (SafetensorError, OSError) as e:
        raise ArtifactError(f"{path}: unreadable weights file ({e}); rebuild the artifact") from None


def _check_names(path: Path, found: set[str], expected: set[str]) -> None:
    missing, extra = sorted(expected - found), sorted(found - expected)
    if missing:
        raise ArtifactError(f"{path}: missing tensor {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if extra:
        raise ArtifactError(f"{path}: unexpected tensor {extra[0]}" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))


def _assign(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    setattr(module, attr, tensor)
