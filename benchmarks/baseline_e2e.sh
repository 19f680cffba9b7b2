#!/usr/bin/env bash
# Throughput/decode of an artifact under an OLDER llmc tree, for same-run baselines (issue 12: the engine
# before overlapped scheduling). OLD_TREE is a checkout of that commit (e.g. `git archive 73466ca | tar -x -C .baseline`).
#
#   bash benchmarks/baseline_e2e.sh OLD_TREE ARTIFACT LABEL OUT_JSON [bench_e2e flags...]
#
# Manifest keys the old tree does not know (async_scheduling, kv_cache_dtype, ...) are removed first,
# in place (the artifact's `files` digests do not cover the manifest in format 1.1); the manifest as it
# was is put back when this script ends, so this tree can run the artifact again after it.
set -euo pipefail
old=$(cd "$1" && pwd); artifact=$(cd "$2" && pwd); label=$3; json=$4; shift 4
kept=$(mktemp)
cp "$artifact/manifest.json" "$kept"
trap 'mv "$kept" "$artifact/manifest.json"' EXIT
# This tree's GPU environment, then the old tree in a package folder of its own on PYTHONPATH instead of
# /tmp/llmcpkg: sourcing the old tree's gpu_env.sh pointed /tmp/llmcpkg at it, and the next run of this
# tree on the machine imported the old code (session 27, call 2).
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/gpu_env.sh"
bash "$here/package_dir.sh" "$old" /tmp/llmcpkg-baseline
export PYTHONPATH=/tmp/llmcpkg-baseline
cd /tmp && python - "$artifact" <<'PY'
# Drop the manifest keys the old tree does not know (async_scheduling, kv_cache_dtype, ...), one per
# "unknown key" error of its own reader, until it reads the manifest.
import json, re, sys
from llmc.errors import ArtifactError
from llmc.runtime import artifact as art
path = f"{sys.argv[1]}/manifest.json"
for _ in range(50):
    try:
        art.read_manifest(sys.argv[1])
        break
    except ArtifactError as exc:
        found = re.search(r"manifest\.json: ([\w.\[\]]+): unknown key", str(exc))
        if not found:
            raise
        *parents, key = found.group(1).split(".")
        manifest = json.load(open(path))
        node = manifest
        for part in parents:
            node = node[part]
        print(f"baseline: dropping manifest key {found.group(1)}")
        node.pop(key)
        json.dump(manifest, open(path, "w"), indent=1)
PY
cd /tmp && python "$old/benchmarks/bench_e2e.py" "$artifact=$label" --json "$json" "$@"
