#!/usr/bin/env bash
# Issue 13's same-run end-to-end check: batch-1 decode and 128/128 throughput of 8B-shaped artifacts
# built and served by this tree and by OLD_TREE (the kernels before), one GPU, one run.
#   bash benchmarks/kernels_vs_before.sh OLD_TREE OUT_DIR "w4 fp8:before bf16:now"
# Each item is w4, w4head (W4A16 with the output head in int4 too), fp8 or bf16, alone (both trees) or
# with :now / :before (one tree, e.g. to split the runs over two calls). bf16 is the reference W4A16
# must beat; its kernels did not change.
# PARTS (default decode,throughput) picks the bench_e2e parts.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
old=$(cd "$1" && pwd); out=$2; work=${WORK:-/tmp/llmc-kernels}
mkdir -p "$out" "$work"
(source "$repo/benchmarks/gpu_env.sh"; python "$repo/benchmarks/make_checkpoint.py" --out "$work/ckpt" | tail -1)
for item in $3; do
  q=${item%%:*}
  case $q in
    w4) method='{method: rtn, bits: 4, group_size: 128, symmetric: true}' ;;
    w4head) method='{method: rtn, bits: 4, group_size: 128, symmetric: true, ignore: []}' ;;  # int4 lm_head too
    fp8) method='{method: fp8}' ;;
    *) method='{method: none}' ;;
  esac
  case $item in *:now) trees="$repo" ;; *:before) trees="$old" ;; *) trees="$repo $old" ;; esac
  for tree in $trees; do
    label=$q-$([ "$tree" = "$repo" ] && echo now || echo before)
    printf 'model: %s/ckpt\noutput: %s/%s\ndtype: bfloat16\nquantization: %s\nruntime: {max_model_len: 4096, max_num_seqs: 256, max_num_batched_tokens: 8192}\ntarget: {device: cuda, gpu_memory_gib: 80}\n' \
      "$work" "$work" "$label" "$method" > "$work/$label.yaml"
    (source "$tree/benchmarks/gpu_env.sh"; cd "$work" && python -m llmc.cli build "$work/$label.yaml" -q | tail -1)
    (source "$tree/benchmarks/gpu_env.sh"; cd /tmp && python "$tree/benchmarks/bench_e2e.py" "$work/$label=$label" \
      --parts "${PARTS:-decode,throughput}" --throughput 128x128:1000 --time-limit 60 --json "$out/e2e-$label.json" | tail -4)
    rm -rf "${work:?}/$label"
  done
done
rm -rf "$work"
