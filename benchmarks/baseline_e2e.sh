#!/usr/bin/env bash
# Throughput/decode of an artifact under an OLDER llmc tree, for same-run baselines (issue 12: the engine
# before overlapped scheduling). OLD_TREE is a checkout of that commit (e.g. `git archive 73466ca | tar -x -C .baseline`).
#
#   bash benchmarks/baseline_e2e.sh OLD_TREE ARTIFACT LABEL OUT_JSON [bench_e2e flags...]
#
# Runtime keys the old tree does not know (async_scheduling) are removed from the manifest first;
# the manifest is rewritten in place (the artifact's `files` digests do not cover it in format 1.1).
set -euo pipefail
old=$(cd "$1" && pwd); artifact=$2; label=$3; json=$4; shift 4
python - "$artifact/manifest.json" <<'PY'
import json, sys
path = sys.argv[1]
manifest = json.load(open(path))
manifest["runtime"].pop("async_scheduling", None)
json.dump(manifest, open(path, "w"), indent=1)
PY
source "$old/benchmarks/gpu_env.sh"  # /tmp/llmcpkg now points at the old tree
cd /tmp && python "$old/benchmarks/bench_e2e.py" "$artifact=$label" --json "$json" "$@"
