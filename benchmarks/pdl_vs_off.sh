#!/usr/bin/env bash
# Programmatic dependent launch (kernels/__init__.use_pdl) against the same kernels launched one after
# the other, end to end, same artifacts, one call: 8B-shaped random-weight artifacts built once, then
# bench_e2e in alternating processes with LLMC_PDL=0 and LLMC_PDL=1 (ROUNDS pairs, default 2).
# VARIANTS="off:LLMC_PDL=0 on:LLMC_PDL=1" (the default) names each process's environment; a variant
# may also run another tree's runtime on the same artifact: "before:PYTHONPATH=/tmp/before now:PYTHONPATH=/tmp/llmcpkg"
# after `bash benchmarks/package_dir.sh OLD_TREE /tmp/before` (benchmarks/runtime_vs_before.sh does that).
# A checkpoint or artifact already in WORK is used as it is (KEEP_WORK=1 keeps them for the next run;
# ROUNDS=0 KEEP_WORK=1 only builds them).
#   bash benchmarks/pdl_vs_off.sh OUT_DIR "w4 w4a bf16 fp8" [PARTS (default decode)]   (w4a: zero points)
# For a dry run on a CPU: CKPT_ARGS="--tiny --device cpu" E2E_ARGS="--device cpu --decode-tokens 4"
# → OUT_DIR/e2e-pdl-Q-VARIANT-ROUND.json and pdl_vs_off.md (one table row per run)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out=$(mkdir -p "$1" && cd "$1" && pwd); quants=$2; parts=${3:-decode}; work=${WORK:-/tmp/llmc-pdl}
rounds=${ROUNDS:-2}
source "$repo/benchmarks/gpu_env.sh"
mkdir -p "$work"
[ -f "$work/ckpt/config.json" ] || python "$repo/benchmarks/make_checkpoint.py" --out "$work/ckpt" ${CKPT_ARGS:-} | tail -1
for q in $quants; do
  case $q in w4) method='{method: rtn, bits: 4, group_size: 128, symmetric: true}' ;;
    w4a) method='{method: rtn, bits: 4, group_size: 128, symmetric: false}' ;; fp8) method='{method: fp8}' ;; *) method='{method: none}' ;; esac
  printf 'model: %s/ckpt\noutput: %s/%s\ndtype: bfloat16\nquantization: %s\nruntime: {max_model_len: 4096, max_num_seqs: 256, max_num_batched_tokens: 8192}\ntarget: {device: cuda, gpu_memory_gib: 80}\n' \
    "$work" "$work" "$q" "$method" > "$work/$q.yaml"
  [ -f "$work/$q/manifest.json" ] || (cd "$work" && python -m llmc.cli build "$work/$q.yaml" -q | tail -1)
  for round in $(seq 1 "$rounds"); do
    for variant in ${VARIANTS:-off:LLMC_PDL=0 on:LLMC_PDL=1}; do
      label=$q-${variant%%:*}
      (cd /tmp && env $(echo "${variant#*:}" | tr , " ") python "$repo/benchmarks/bench_e2e.py" "$work/$q=$label" --parts "$parts" \
        --throughput 128x128:1000 --time-limit 60 --json "$out/e2e-pdl-$label-$round.json" ${E2E_ARGS:-} | tail -3)
      python -c "import json,sys; print(json.load(open(sys.argv[1]))['table'])" "$out/e2e-pdl-$label-$round.json" \
        | grep '^| ' | grep -v '^| artifact' | sed "s/^/| $round /" >> "$out/pdl_vs_off.md"
    done
  done
  [ -n "${KEEP_WORK:-}" ] || rm -rf "${work:?}/$q"
done
[ -n "${KEEP_WORK:-}" ] || rm -rf "$work"
[ "$rounds" = 0 ] || cat "$out/pdl_vs_off.md"
