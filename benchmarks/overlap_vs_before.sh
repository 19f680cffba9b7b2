#!/usr/bin/env bash
# Issue 12's same-run baseline: 128/128 throughput (and batch-1 decode) of the 8B-shaped bf16 and FP8
# artifacts under this tree (overlapped scheduling) and under OLD_TREE (the engine before it), one GPU,
# one run.   bash benchmarks/overlap_vs_before.sh OLD_TREE OUT_DIR
# (OLD_TREE e.g. from `git archive 73466ca | tar -x -C .baseline`; carry it to the device machine.)
# PARTS (default decode,throughput) picks bench_e2e's parts; QUANTS (default "bf16 fp8") the artifacts;
# NOW_SEQS="512 1024" adds runs of this tree at those run-time max_num_seqs (the build's is 256), and
# NOW_VARIANTS="kvfp8:kv_cache_dtype=fp8 kvfp8-512:kv_cache_dtype=fp8,max_num_seqs=512" runs of this
# tree with those engine options (LABEL:KEY=VALUE,...), to the same bench_e2e call. OLD_SEQS (default 256)
# runs the old tree once per max_num_seqs listed (its bench_e2e's --max-num-seqs), after this tree's runs.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
old=$(cd "$1" && pwd); out=$2; work=${WORK:-/tmp/llmc-overlap}; parts=${PARTS:-decode,throughput}
mkdir -p "$out" "$work"
source "$repo/benchmarks/gpu_env.sh"
python "$repo/benchmarks/make_checkpoint.py" --out "$work/ckpt" | tail -1
for q in ${QUANTS:-bf16 fp8}; do
  method=$([ $q = fp8 ] && echo fp8 || echo none)
  printf 'model: %s/ckpt\noutput: %s/%s\ndtype: bfloat16\nquantization: {method: %s}\nruntime: {max_model_len: 4096, max_num_seqs: 256, max_num_batched_tokens: 8192}\ntarget: {device: cuda, gpu_memory_gib: 80}\n' \
    "$work" "$work" $q $method > "$work/$q.yaml"
  (source "$repo/benchmarks/gpu_env.sh"; cd "$work" && python -m llmc.cli build "$work/$q.yaml" -q | tail -1)
  now=("$work/$q=$q-overlap")
  for seqs in ${NOW_SEQS:-}; do now+=("$work/$q=$q-overlap-seqs$seqs@max_num_seqs=$seqs"); done
  for variant in ${NOW_VARIANTS:-}; do now+=("$work/$q=$q-overlap-${variant%%:*}@${variant#*:}"); done
  (source "$repo/benchmarks/gpu_env.sh"; cd /tmp && python "$repo/benchmarks/bench_e2e.py" "${now[@]}" \
    --parts "$parts" --throughput 128x128:1000 --time-limit 60 --json "$out/e2e-$q-overlap.json" | tail -16)
  for seqs in ${OLD_SEQS:-256}; do
    bash "$repo/benchmarks/baseline_e2e.sh" "$old" "$work/$q" "$q-before-$seqs" "$out/e2e-$q-before-$seqs.json" \
      --parts "$parts" --throughput 128x128:1000 --time-limit 60 --max-num-seqs "$seqs" | tail -8
  done
  rm -rf "${work:?}/$q"
done
rm -rf "$work"
