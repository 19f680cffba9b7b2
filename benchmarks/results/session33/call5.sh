#!/usr/bin/env bash
# Session 33, call 5: cold start of an 8B-shaped W4A16 artifact (`llmc run --prompt`, process start to first
# token; bench_e2e.py --parts cold, empty then warm Triton cache) with the prefill step eager
# (FULL_DECODE_ONLY: the engine before) and with the piecewise graphs (the default), which capture 12 sizes at start.
set -u
source benchmarks/gpu_env.sh
repo=$PWD
work=/tmp/w33; mkdir -p $work/recipes
log=$OUT/call5.log
say() { echo "[$(date +%H:%M:%S) +${SECONDS}s] $*" | tee -a $log; }
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $log
(cd /tmp && python $repo/benchmarks/make_checkpoint.py --out $work/ckpt > $work/ckpt.log 2>&1)
cat > $work/recipes/w4a16.yaml <<EOR
model: $work/ckpt
output: $work/w4a16
dtype: bfloat16
quantization: {method: rtn, bits: 4, group_size: 128, symmetric: true}
runtime: {max_model_len: 4096, max_num_seqs: 256, max_num_batched_tokens: 8192}
target: {device: cuda, gpu_memory_gib: 80}
EOR
(cd /tmp && python -m llmc.cli build $work/recipes/w4a16.yaml -q > $work/build.log 2>&1)
say "built"; tail -1 $work/build.log >> $log
(cd /tmp && timeout 240 python $repo/benchmarks/bench_e2e.py \
   "$work/w4a16=w4-eager-prefill@compilation_config={\"cudagraph_mode\":\"FULL_DECODE_ONLY\"}" \
   "$work/w4a16=w4-piecewise" --parts cold --cold-timeout 90 --json $OUT/cold-w4a16.json >> $log 2>&1)
say "cold done"
grep -E "first token|CUDA graphs|\| w4" $log | head -20
