#!/usr/bin/env bash
# Make the repo importable as `llmc` on the GPU machine, which has no network for `pip install -e .`:
# a folder of symlinks that mirrors the setuptools package-dir mapping (benchmarks/package_dir.sh).
# Usage: source benchmarks/gpu_env.sh
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/benchmarks/package_dir.sh" "$repo" /tmp/llmcpkg
export PYTHONPATH=/tmp/llmcpkg${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
