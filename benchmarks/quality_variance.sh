#!/usr/bin/env bash
# How much a setting's perplexity moves with its calibration sample: quality_table.py for GPTQ (float
# targets on and off) and AWQ, calibrated on the first 128 windows and on 128 drawn at random (seeds 1, 2).
# On the device machine: bash benchmarks/quality_variance.sh OUT_DIR   (data in .carry/data)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo/benchmarks/gpu_env.sh"
out=$1
mkdir -p "$out"
data=${DATA:-$repo/.carry/data}
jobs=${JOBS:-4}
cd /tmp
run() {  # run NAME SEED ARGS...
  local name=$1 seed=$2; shift 2
  local args=(--out "$out/$name-s$seed" --calib "$data/wikitext2-valid.txt" --heldout "$data/heldout.txt" --jobs "$jobs" "$@")
  [ "$seed" != 0 ] && args+=(--calib-seed "$seed")
  python "$repo/benchmarks/quality_table.py" "${args[@]}" | grep -v '^|'
}
for seed in 0 1 2; do  # GPTQ: the seeds side by side (3 x 4 builds share the GPU well)
  {
    run gptq-ft "$seed" --only gptq-w4-pc-sym gptq-w4-g128-sym gptq-w3-g128-sym --set float_targets=true
    run gptq "$seed" --only gptq-w4-pc-sym gptq-w4-g128-sym gptq-w3-g128-sym --set float_targets=false
  } > "$out/gptq-seed$seed.log" 2>&1 &
done
wait
cat "$out"/gptq-seed*.log
# AWQ: one seed at a time. Twelve AWQ builds at once time-slice the GPU so badly that they did not
# finish in 8 minutes; four at a time take about a minute per seed.
for seed in 0 1 2; do
  run awq "$seed" --only awq-w4-pc-asym awq-w4-pc-sym awq-w4-g128-asym awq-w3-g128-asym
done
