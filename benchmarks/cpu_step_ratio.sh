#!/usr/bin/env bash
# Issue 12's CPU check: ref-llama-12m decoding 1, 16 and 256 sequences together; the engine's wall time
# per decode step over the model forward's time in the same steps (benchmarks/profile_step.py), with
# the overlap and without, on N cores (default 2, as on the dev machine and CI).
#   bash benchmarks/cpu_step_ratio.sh OUT_DIR [CORES]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out=$1; cores=${2:-2}; work=$(mktemp -d)
mkdir -p "$out"
export OMP_NUM_THREADS=$cores
pin=(); command -v taskset >/dev/null && pin=(taskset -c "0-$((cores - 1))")
cd "$work"  # not the repository root: its ./llmc folder would shadow the package
sed "s|^model: .*|model: $repo/checkpoints/ref-llama-12m|; s|^output: .*|output: $work/ref|" \
  "$repo/recipes/ref-llama-12m.yaml" > recipe.yaml
python -m llmc.cli build recipe.yaml -q > /dev/null
for mode in async sync; do
  "${pin[@]}" python "$repo/benchmarks/profile_step.py" "$work/ref" --device cpu --batch-sizes 1,16,256 \
    --steps 40 --max-model-len 256 --prompt-len 32 $([ $mode = sync ] && echo --sync) --json "$out/cpu-step-$mode.json"
done
rm -rf "$work"
