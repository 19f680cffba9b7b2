"""Writing an artifact: a streaming safetensors writer and the atomic temp-directory-then-swap.

The writer takes every tensor's name, dtype and shape up front (the formats' `param_specs` give
them before any weight is quantized), writes the header, then the tensors one at a time as the
compiler produces them — so a build never holds the whole model in memory.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import json
import logging
import os
import re
import secrets
import shutil
import socket
import struct
from contextlib import contextmanager
from pathlib import Path

import torch

from llmc.errors import ArtifactError, CheckpointError, LlmcError, RecipeError

logger = logging.getLogger("llmc")

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
        if data.is_floating_point() and data.element_size() >= 2 and not torch.isfinite(data).all():
            limit = f" ({data.dtype} holds at most {torch.finfo(data.dtype).max:g})" if data.dtype == torch.float16 else ""
            raise CheckpointError(f"{name}: inf or NaN in the {data.dtype} tensor{limit}; the checkpoint's value does "
                                  "not fit this dtype: build with dtype bfloat16 or float32 (or the checkpoint itself "
                                  "holds inf/NaN)")
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
    """Yield a new temporary sibling of `final`; on success swap it into place, on failure remove it.

    NOTE: a crashed build never leaves a directory that looks like an artifact, and the name always
    holds a whole artifact, old or new: the manifest is written last, the temporary directory is named
    `.NAME.building-HOST.PID-RANDOM` (so that a later build can tell a killed build's leftovers from a
    running one's), and the swap is one renameat2(RENAME_EXCHANGE) where the kernel and filesystem
    have it (Linux 3.15+: ext4, xfs, btrfs, tmpfs, ...). Elsewhere POSIX has no atomic replacement of
    a non-empty directory: the old artifact is renamed aside to `.NAME.old-HOST.PID-RANDOM` first, and
    a build killed between the two renames leaves it there, for `recover_output` to put back.
    """
    final = Path(os.path.abspath(final))
    prepare_output(final)
    try:
        tmp = _make_temp_dir(final, "building")
    except OSError as e:  # a read-only or foreign folder: before any work
        raise RecipeError(f"output: cannot write in {final.parent} ({e.strerror}); choose another output") from None
    try:
        yield tmp
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.filename is not None and not str(e.filename).startswith(str(tmp)):
            raise  # a file outside the artifact (the checkpoint, a calibration file): its own error
        raise ArtifactError(f"output: writing the artifact in {final.parent} failed ({e.strerror}); free space "
                            "there or choose another output") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        _check_replaceable(final)
    except LlmcError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _swap_into_place(tmp, final)


def prepare_output(final: Path, create: bool = True) -> None:
    """Refuse an output that cannot become an artifact, before any work; then clean what killed builds
    at this output left (their temporary directories, an old artifact renamed aside). `create` false: make
    no directory yet (a build that fails later must not leave empty ones), only check that it could."""
    final = Path(os.path.abspath(final))
    if final.parent.exists() and not final.parent.is_dir():
        raise RecipeError(f"output: {final.parent} is a file, not a directory; choose another output")
    _check_replaceable(final)
    if not create:
        existing = next(p for p in final.parents if p.exists())
        if not existing.is_dir():
            raise RecipeError(f"output: {existing} is a file, not a directory; choose another output")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise RecipeError(f"output: cannot write in {existing} (Permission denied); choose another output")
        if final.parent.is_dir():
            recover_output(final)
        return
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RecipeError(f"output: cannot create {final.parent} ({e.strerror}); choose another output") from None
    recover_output(final)


def _check_replaceable(final: Path) -> None:
    if final.is_symlink() or (final.exists() and not final.is_dir()):
        raise RecipeError(f"output: {final} exists and is not a directory; choose another output or remove it")
    if final.is_dir() and not (final / "manifest.json").is_file() and any(final.iterdir()):
        raise RecipeError(f"output: {final} exists and is not an llmc artifact; choose another output or remove it")


def recover_output(final: Path) -> list[Path]:
    """Put back an old artifact that a killed swap left aside (when the name is empty), and remove the
    temporary directories of builds at this output whose process is gone; returns what it removed.
    Directories of a live build, or of another host, are left alone."""
    stale = sorted(p for p in final.parent.iterdir() if _is_stale(p, final.name))
    for path in stale:
        if path.name.startswith(f".{final.name}.old-") and not os.path.lexists(final) \
                and (path / "manifest.json").is_file():
            os.rename(path, final)
            logger.warning("output: put back %s, which an interrupted build had moved aside to %s", final, path.name)
    removed = [path for path in stale if path.exists()]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    if removed:
        logger.info("output: removed %d director%s left by killed builds of %s", len(removed),
                    "y" if len(removed) == 1 else "ies", final.name)
    return removed


_TEMP_NAME = re.compile(r"^\.(?P<name>.+)\.(?:building|old)-(?P<host>[A-Za-z0-9.-]*)\.(?P<pid>\d+)-[0-9a-f]+$")


def _is_stale(path: Path, name: str) -> bool:
    match = _TEMP_NAME.match(path.name)
    if not match or match["name"] != name or match["host"] != _host() or not path.is_dir() or path.is_symlink():
        return False
    return not _is_alive(int(match["pid"]))


def _is_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())


def _make_temp_dir(final: Path, kind: str) -> Path:
    """`.NAME.KIND-HOST.PID-RANDOM`, created with the usual permissions (0777 less the umask, as
    mkdir gives; tempfile.mkdtemp would make it 0700)."""
    while True:
        path = final.with_name(f".{final.name}.{kind}-{_host()}.{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.mkdir(path, 0o777)
            return path
        except FileExistsError:
            continue


def _swap_into_place(tmp: Path, final: Path) -> None:
    if not os.path.lexists(final):
        os.rename(tmp, final)
        return
    if _exchange(tmp, final):
        shutil.rmtree(tmp, ignore_errors=True)  # now the old artifact
        return
    old = final.with_name(tmp.name.replace(".building-", ".old-", 1))
    os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux's renameat2(RENAME_EXCHANGE); False where it is unavailable."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


@functools.cache
def _renameat2():
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn
