"""Whether an artifact's files check out: the manifest's own digest, the `files` table, the weights.

- `manifest_digest`: sha256 of the manifest's canonical JSON without its `manifest_sha256` key.
- `check_entries` / `check_present`: every `files` entry is a confined relative path with a sha256
  and a size, and (stat only, nothing is opened) a regular file of that size.
- `verify_for_load`: what the runtime does before loading a file. The first load hashes it and
  records a stamp beside the artifact (`.llmc-verified.json`: size, mtime, ctime, inode, device and
  the digest it matched); a later load whose stat matches the stamp skips the hash. DESIGN §2 says
  what the stamp does and does not protect against.
- `read_safetensors_header`: a header checked against the file before anything is allocated.

Nothing here imports the rest of llmc except the errors: artifact.py re-exports what others use.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import stat
import time
from pathlib import Path, PurePosixPath

from llmc.errors import ArtifactError

logger = logging.getLogger("llmc")

DIGEST_KEY = "manifest_sha256"
STAMP_NAME = ".llmc-verified.json"
STAMP_MIN_AGE_NS = 1_000_000_000  # a file changed this recently is hashed but not stamped (same-tick rewrites)
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit on a header
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_STAT_KEYS = ("size", "mtime_ns", "ctime_ns", "ino", "dev")


def canonical_json(data) -> bytes:
    """The bytes the manifest digest covers: sorted keys, no spaces, ASCII, no NaN or Infinity."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def manifest_digest(data: dict) -> str:
    """sha256 of the manifest's canonical JSON without its own digest key."""
    return hashlib.sha256(canonical_json({k: v for k, v in data.items() if k != DIGEST_KEY})).hexdigest()


def check_digest(data: dict, where: Path, required: bool) -> None:
    recorded = data.get(DIGEST_KEY)
    if recorded is None:
        if required:
            raise ArtifactError(f"{where}: {DIGEST_KEY} is missing; the manifest cannot be trusted, rebuild the artifact")
        return
    if recorded != manifest_digest(data):
        raise ArtifactError(f"{where}: the manifest does not match its {DIGEST_KEY} (edited or corrupted); "
                            "rebuild the artifact")


def parse_json_strict(text: str):
    """json.loads that refuses NaN and Infinity (JSON has neither)."""
    def refuse(name):
        raise ValueError(f"{name} is not a JSON number")
    return json.loads(text, parse_constant=refuse)


def check_entries(files) -> None:
    """Each `files` entry: a relative path inside the artifact → {"sha256": 64 hex digits, "size": bytes}."""
    if not isinstance(files, dict):
        raise ArtifactError("manifest.json: files must be a mapping of paths to {sha256, size}; rebuild the artifact")
    for rel, entry in files.items():
        if not is_confined(rel):
            raise ArtifactError(f"manifest.json: files entry {rel!r} is not a relative path inside the artifact; "
                                "rebuild the artifact")
        ok = (isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and _SHA256.match(entry["sha256"])
              and type(entry.get("size")) is int and entry["size"] >= 0)
        if not ok:
            raise ArtifactError(f"manifest.json: files entry {rel!r} needs a sha256 (64 hex digits) and a size "
                                f"(bytes), got {entry!r}; rebuild the artifact")


def is_confined(rel) -> bool:
    """A plain relative POSIX path: no '..', not absolute, no empty or '.' parts, no backslashes."""
    if not isinstance(rel, str) or not rel or "\\" in rel or "\0" in rel:
        return False
    path = PurePosixPath(rel)
    return not path.is_absolute() and all(part not in ("", ".", "..") for part in rel.split("/"))


def regular_file(root: Path, rel: str) -> tuple[os.stat_result | None, str | None]:
    """(stat, None) when rel names a regular file inside root (symlinks resolved, nothing opened);
    (None, None) when nothing is there; (None, what is wrong) for anything else (a FIFO, a directory,
    a link out of the artifact, an unreadable path)."""
    path = root / rel
    try:
        st = path.stat()
    except FileNotFoundError:
        return None, None
    except OSError as e:
        return None, f"cannot be read ({e.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return None, f"is not a regular file ({_kind(st.st_mode)})"
    if not path.resolve().is_relative_to(root.resolve()):
        return None, "is a link to a file outside the artifact"
    return st, None


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    return next((label for test, label in kinds if test(mode)), "not a plain file")


def check_present(root: Path, files: dict, rel: str) -> os.stat_result:
    """Refuse a missing, non-regular or resized file (stat only); returns its stat."""
    entry = files.get(rel)
    st, problem = regular_file(root, rel)
    if problem is not None:
        raise ArtifactError(f"{root}: {rel} {problem}; rebuild the artifact")
    if entry is None or st is None:
        raise ArtifactError(f"{root}: {rel} is missing; rebuild the artifact")
    if st.st_size != entry["size"]:
        raise ArtifactError(f"{root}: {rel} is {st.st_size} bytes but the manifest says {entry['size']} "
                            "(truncated or replaced); rebuild the artifact or run `llmc inspect --verify`")
    return st


def sha256_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def verify_files(root: Path, files: dict) -> list[str]:
    """Re-hash every file; one problem line per missing, non-regular, resized or corrupted file."""
    problems = []
    for rel, entry in files.items():
        st, problem = regular_file(root, rel)
        if problem is not None:
            problems.append(f"{rel}: {problem}")
        elif st is None:
            problems.append(f"{rel}: missing")
        elif st.st_size != entry["size"]:
            problems.append(f"{rel}: size {st.st_size} bytes, expected {entry['size']} (truncated?)")
        elif sha256_file(root / rel) != entry["sha256"]:
            problems.append(f"{rel}: sha256 mismatch (corrupted)")
    return problems


def verify_for_load(root: Path, files: dict, rel_paths: list[str]) -> None:
    """Refuse any of rel_paths that is missing, resized or whose sha256 is not the manifest's; files whose
    stat matches the stamp of an earlier verification are not hashed again."""
    stamps = _read_stamps(root)
    fresh = {}
    for rel in rel_paths:
        st = check_present(root, files, rel)
        expected = files[rel]["sha256"]
        if stamps.get(rel) == _stamp(st, expected):
            continue
        start_ns = time.time_ns()
        seconds = time.perf_counter()
        if sha256_file(root / rel) != expected:
            raise ArtifactError(f"{root}: {rel} does not match its sha256 in the manifest (corrupted or changed); "
                                "rebuild the artifact or run `llmc inspect --verify`")
        if st.st_size > 1 << 26:
            logger.info("verified %s (%.1f GB) in %.1f s; later starts skip this until the file changes",
                        rel, st.st_size / 1e9, time.perf_counter() - seconds)
        after = (root / rel).stat()
        if _stamp(after, expected) == _stamp(st, expected) and after.st_ctime_ns < start_ns - STAMP_MIN_AGE_NS:
            fresh[rel] = _stamp(st, expected)
    if fresh:
        _write_stamps(root, {**stamps, **fresh})


def _stamp(st: os.stat_result, sha256: str) -> dict:
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "ino": st.st_ino,
            "dev": st.st_dev, "sha256": sha256}


def _read_stamps(root: Path) -> dict:
    """The recorded stamps; an unreadable or malformed stamp file counts as none (everything is hashed)."""
    try:
        data = parse_json_strict((root / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return data.get("files", {}) if isinstance(data, dict) and isinstance(data.get("files"), dict) else {}


def _write_stamps(root: Path, stamps: dict) -> None:
    """Atomically replace the stamp file; a read-only artifact keeps none (and is hashed at every start)."""
    tmp = root / f"{STAMP_NAME}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps({"version": 1, "files": stamps}, indent=1) + "\n")
        os.replace(tmp, root / STAMP_NAME)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        logger.info("cannot record the verification stamp in %s (%s): every start hashes the weights",
                    root, e.strerror)


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """{tensor name: {dtype, shape, data_offsets}} from a safetensors file's header, checked against the
    file's size before anything is allocated; a malformed header is an ArtifactError naming the file."""
    st, problem = regular_file(path.parent, path.name)
    if st is None:
        raise ArtifactError(f"{path} {problem or 'is missing'}; rebuild the artifact")
    size = st.st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        header_len = int.from_bytes(prefix, "little")
        if len(prefix) < 8 or not 2 <= header_len <= min(MAX_HEADER_BYTES, size - 8):
            raise ArtifactError(f"{path}: not a safetensors file (header length {header_len if len(prefix) == 8 else 'missing'}, "
                                f"file {size} bytes); rebuild the artifact")
        try:
            header = parse_json_strict(f.read(header_len).decode())
        except (UnicodeDecodeError, ValueError) as e:
            raise ArtifactError(f"{path}: the safetensors header is not valid JSON ({e}); rebuild the artifact") from None
    if not isinstance(header, dict):
        raise ArtifactError(f"{path}: the safetensors header is not a JSON object; rebuild the artifact")
    header.pop("__metadata__", None)
    for name, entry in header.items():
        _check_tensor_entry(path, name, entry, size - 8 - header_len)
    return header


def _check_tensor_entry(path: Path, name: str, entry, data_bytes: int) -> None:
    ok = (isinstance(entry, dict) and isinstance(entry.get("dtype"), str) and isinstance(entry.get("shape"), list)
          and all(type(d) is int and d >= 0 for d in entry["shape"]) and isinstance(entry.get("data_offsets"), list)
          and len(entry["data_offsets"]) == 2 and all(type(o) is int for o in entry["data_offsets"]))
    if ok:
        start, end = entry["data_offsets"]
        ok = 0 <= start <= end <= data_bytes
    if not ok:
        raise ArtifactError(f"{path}: tensor {name!r} has a malformed header entry {entry!r}; rebuild the artifact")
