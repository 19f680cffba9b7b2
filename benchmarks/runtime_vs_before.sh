#!/usr/bin/env bash
# A runtime change (kernels, engine; not the artifact format) against the tree before it, one GPU call:
#   1. benchmarks/attention_step_bench.py under OLD_TREE and this tree, alternating (ROUNDS pairs);
#   2. GPU tests (TESTS, pytest -m gpu paths) in the background while the W4A16 8B-shaped artifact
#      builds (once, with this tree: the format did not change);
#   3. batch-1 decode of that artifact, alternating processes of OLD_TREE's and this tree's runtime
#      (benchmarks/pdl_vs_off.sh with PYTHONPATH variants).
#   bash benchmarks/runtime_vs_before.sh OLD_TREE OUT_DIR ["tests/... tests/..."]
# QUANTS names the artifacts (pdl_vs_off.sh's names; default w4, RTN g128 symmetric; w4a with zero points).
# ATTN_ARGS adds arguments to both attention_step_bench runs (e.g. "--batch-sizes 1,4,16"); ATTN_ARGS=skip skips them.
# → OUT_DIR/attention-{before,now}-ROUND.json, gpu_tests.log, e2e-pdl-w4-{before,now}-ROUND.json, pdl_vs_off.md
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
old=$(cd "$1" && pwd); out=$(mkdir -p "$2" && cd "$2" && pwd); tests=${3:-}; rounds=${ROUNDS:-2}; quants=${QUANTS:-w4}
export WORK=${WORK:-/tmp/llmc-pdl} KEEP_WORK=1 PYTHONUNBUFFERED=1
source "$repo/benchmarks/gpu_env.sh"
bash "$repo/benchmarks/package_dir.sh" "$old" /tmp/before
say() { echo "[$(date +%H:%M:%S) +${SECONDS}s] $*"; }
for round in $(seq 1 "$rounds"); do
  [ "${ATTN_ARGS:-}" = skip ] && break
  for variant in before:/tmp/before now:/tmp/llmcpkg; do
    say "attention_step_bench ${variant%%:*} $round"
    (cd /tmp && PYTHONPATH=${variant#*:} timeout 120 python "$repo/benchmarks/attention_step_bench.py" \
      --json "$out/attention-${variant%%:*}-$round.json" ${ATTN_ARGS:-})
  done
done
if [ -n "$tests" ]; then
  say "GPU tests: start (background)"
  (cd "$repo" && timeout "${TESTS_LIMIT_S:-300}" python -P -m pytest -q -m gpu -p no:cacheprovider $tests \
    > "$out/gpu_tests.log" 2>&1; echo "exit $?" >> "$out/gpu_tests.log") &
fi
say "checkpoint + W4A16 build: start"
ROUNDS=0 bash "$repo/benchmarks/pdl_vs_off.sh" "$out" "$quants"  # builds only (KEEP_WORK), the recipe its runs use
say "build: done; waiting for the tests"
wait
tail -3 "$out/gpu_tests.log" 2>/dev/null
say "decode, before vs now: start"
VARIANTS="before:PYTHONPATH=/tmp/before now:PYTHONPATH=/tmp/llmcpkg" ROUNDS=$rounds \
  timeout "${E2E_LIMIT_S:-260}" bash "$repo/benchmarks/pdl_vs_off.sh" "$out" "$quants" decode
say "done"
