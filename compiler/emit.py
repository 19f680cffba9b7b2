"""Writing an artifact: a streaming safetensors writer and the atomic temp-directory-then-rename.

The writer takes every tensor's name, dtype and shape up front (the formats' `param_specs` give
them before any weight is quantized), writes the header, then the tensors one at a time as the
compiler produces them — so a build never holds the whole model in memory.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from llmc.errors import LlmcError

SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
}


class SafetensorsWriter:
    """Write tensors in the order their specs were given. `specs`: [(name, dtype, shape)]."""

    def __init__(self, path: Path, specs: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict | None = None):
        self.path = path
        self.order = [name for name, _, _ in specs]
        self.specs = {name: (dtype, tuple(shape)) for name, dtype, shape in specs}
        header, offset = {}, 0
        for name, dtype, shape in specs:
            num_bytes = _num_elements(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + num_bytes]}
            offset += num_bytes
        if metadata:
            header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(raw)) + raw)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self.order[self._next] if self._next < len(self.order) else None
        if name != expected:
            raise RuntimeError(f"safetensors writer: got {name!r}, expected {expected!r} next")
        dtype, shape = self.specs[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise RuntimeError(f"{name}: {tensor.dtype} {tuple(tensor.shape)} does not match its spec {dtype} {shape}")
        data = tensor.detach().contiguous().cpu().reshape(-1)
        self._file.write(data.view(torch.uint8).numpy().tobytes())
        self._next += 1

    @property
    def next_name(self) -> str | None:
        """The tensor the writer expects next (None once every tensor is written)."""
        return self.order[self._next] if self._next < len(self.order) else None

    def close(self) -> None:
        self._file.close()
        if self._next != len(self.order):
            raise RuntimeError(f"safetensors writer: {len(self.order) - self._next} tensors were never written")


class ShardedWriter:
    """One SafetensorsWriter per rank, all open at once. Tensors may arrive for a rank in any order
    within a unit (a layer, a global module): each is held until every tensor before it in the
    rank's file is written, so at most about one unit per rank is in memory."""

    def __init__(self, paths: list[Path], rank_specs: list[list[tuple[str, torch.dtype, tuple[int, ...]]]],
                 metadata: dict | None = None):
        self.writers = [SafetensorsWriter(path, specs, metadata) for path, specs in zip(paths, rank_specs, strict=True)]
        self.pending: list[dict[str, torch.Tensor]] = [{} for _ in self.writers]

    def write(self, rank: int, tensors: dict[str, torch.Tensor]) -> int:
        """Queue a rank's tensors and write what is next in its file; returns how many were written."""
        writer, pending = self.writers[rank], self.pending[rank]
        pending.update(tensors)
        num_written = 0
        while writer.next_name in pending:
            name = writer.next_name
            writer.write(name, pending.pop(name))
            num_written += 1
        return num_written

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        for rank, pending in enumerate(self.pending):
            if pending:
                raise RuntimeError(f"rank {rank}: produced tensors the runtime does not load: {sorted(pending)[:5]}")


def _num_elements(shape) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n


@contextmanager
def atomic_directory(final: Path):
    """Yield a temporary sibling of `final`; on success swap it into place, on failure remove it.

    A crashed build never leaves a directory that looks like an artifact: the manifest is written
    last, and the directory only appears under its final name after everything is complete.
    """
    final = final.resolve()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.building-", dir=final.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if final.exists():
        if not (final / "manifest.json").is_file() and any(final.iterdir()):
            shutil.rmtree(tmp, ignore_errors=True)
            raise LlmcError(f"output {final} exists and is not an llmc artifact; choose another `output` or remove it")
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
