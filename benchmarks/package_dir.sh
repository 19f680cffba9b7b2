#!/usr/bin/env bash
# Make a tree importable as `llmc` without `pip install -e .` (the GPU machine has no network): a
# folder of symlinks that mirrors the setuptools package-dir mapping. Put DIR on PYTHONPATH.
#   bash benchmarks/package_dir.sh TREE DIR      (DIR is replaced)
# gpu_env.sh does this for the tree it is in; a second tree (the code before a change) gets its own
# DIR, and a benchmark process picks one with PYTHONPATH (pdl_vs_off.sh's VARIANTS).
set -euo pipefail
tree=$(cd "$1" && pwd); pkg=$2/llmc
rm -rf "$2" && mkdir -p "$pkg"
for f in "$tree"/llmc/*.py; do ln -s "$f" "$pkg/"; done
for sub in compiler quant kernels runtime; do ln -s "$tree/$sub" "$pkg/$sub"; done
