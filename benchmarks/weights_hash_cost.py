"""What verifying an artifact's weights on load costs on this CPU (issue 20; DESIGN §2).

Writes one safetensors file of --gib GiB (bf16 tensors of an 8B model's layer shapes) and times,
each on a cold page cache (the file evicted with posix_fadvise(DONTNEED)) and a warm one:

  load       safetensors' safe_open + get_tensor + clone of every tensor: the bytes a start reads
  sha256     hashlib.sha256 over the file in 1 MiB reads: what `llmc run` does on first load
  blake2b    hashlib.blake2b, the fastest other digest in the standard library, for comparison
  stamp      the verified-stamp check that replaces hashing on later starts (one os.stat per file)

    python benchmarks/weights_hash_cost.py --gib 1.5 --path /tmp/llmc_hash_cost.safetensors
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def write_file(path: Path, gib: float) -> None:
    shapes = [(14336, 4096), (4096, 14336), (6144, 4096), (4096, 4096)]  # one Llama-3-8B layer, roughly
    tensors, total, i = {}, 0, 0
    gen = torch.Generator().manual_seed(0)
    while total < gib * 2**30:
        shape = shapes[i % len(shapes)]
        tensors[f"t{i}"] = torch.randn(shape, generator=gen, dtype=torch.float32).to(torch.bfloat16)
        total += tensors[f"t{i}"].numel() * 2
        i += 1
    save_file(tensors, str(path))


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def digest(path: Path, name: str) -> str:
    h = hashlib.new(name)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def load(path: Path) -> int:
    n = 0
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for name in f.keys():
            n += f.get_tensor(name).clone().numel()  # get_tensor maps the file: clone reads the bytes
    return n


def stamp(path: Path) -> tuple:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev


def timed(fn, path: Path, cold: bool) -> float:
    if cold:
        evict(path)
    start = time.perf_counter()
    fn(path)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=1.5)
    parser.add_argument("--path", type=Path, default=Path("/tmp/llmc_hash_cost.safetensors"))
    parser.add_argument("--keep", action="store_true", help="keep the file afterwards")
    args = parser.parse_args()
    if not args.path.is_file():
        write_file(args.path, args.gib)
    size_gb = args.path.stat().st_size / 1e9
    print(f"file: {args.path} {size_gb:.2f} GB; torch threads {torch.get_num_threads()}")
    print(f"{'step':<10}{'cache':<7}{'seconds':>9}{'s per GB':>10}{'GB/s':>8}")
    rows = [("load", load), ("sha256", lambda p: digest(p, "sha256")), ("blake2b", lambda p: digest(p, "blake2b"))]
    for label, fn in rows:
        for cold in (True, False):
            seconds = timed(fn, args.path, cold)
            print(f"{label:<10}{'cold' if cold else 'warm':<7}{seconds:>9.3f}{seconds / size_gb:>10.3f}{size_gb / seconds:>8.2f}")
    start = time.perf_counter()
    for _ in range(1000):
        stamp(args.path)
    print(f"{'stamp':<10}{'-':<7}{(time.perf_counter() - start) / 1000:>9.6f}  (one os.stat)")
    if not args.keep:
        args.path.unlink()


if __name__ == "__main__":
    main()
