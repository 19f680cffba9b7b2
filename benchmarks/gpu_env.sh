#!/usr/bin/env bash
# Make the repo importable as `llmc` on the GPU machine, which has no network for `pip install -e .`:
# a folder of symlinks that mirrors the setuptools package-dir mapping. Usage: source benchmarks/gpu_env.sh
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
pkg=/tmp/llmcpkg/llmc
rm -rf /tmp/llmcpkg && mkdir -p "$pkg"
for f in "$repo"/llmc/*.py; do ln -s "$f" "$pkg/"; done
for sub in compiler quant kernels runtime; do ln -s "$repo/$sub" "$pkg/$sub"; done
export PYTHONPATH=/tmp/llmcpkg${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
