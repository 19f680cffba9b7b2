#!/usr/bin/env bash
# Session 33, call 1: piecewise CUDA graphs of prefill and mixed steps (runtime/piecewise_graphs.py). The GPU
# tests of the engine's graphs, then one short request's TTFT on an 8B-shaped W4A16 artifact with the
# prefill step eager (FULL_DECODE_ONLY: what the engine did before) and through the pieces
# (FULL_AND_PIECEWISE, the new default), alternating, two rounds, in one process per mode. One log.
set -u
source benchmarks/gpu_env.sh
repo=$PWD
work=/tmp/w33; mkdir -p $work/recipes
log=$OUT/call1.log
say() { echo "[$(date +%H:%M:%S) +${SECONDS}s] $*" | tee -a $log; }
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader | tee -a $log
(cd /tmp && python $repo/benchmarks/make_checkpoint.py --out $work/ckpt > $work/ckpt.log 2>&1)
say "checkpoint written"
cat > $work/recipes/w4a16.yaml <<EOR
model: $work/ckpt
output: $work/w4a16
dtype: bfloat16
quantization: {method: rtn, bits: 4, group_size: 128, symmetric: true}
runtime: {max_model_len: 4096, max_num_seqs: 256, max_num_batched_tokens: 8192}
target: {device: cuda, gpu_memory_gib: 80}
EOR
(cd /tmp && python -m llmc.cli build $work/recipes/w4a16.yaml -q > $work/build-w4a16.log 2>&1) &
say "gpu tests (build running)"
timeout 240 python -P -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_piecewise_graphs.py \
  tests/runtime/test_cuda_graphs.py tests/runtime/test_overlap.py tests/runtime/test_memory_plan.py 2>&1 | tail -25 >> $log
say "gpu tests done"
wait
say "build done"; tail -2 $work/build-w4a16.log >> $log
(cd /tmp && timeout 280 python $repo/benchmarks/prefill_host.py $work/w4a16=w4a16 --prompt-lens 16 128 512 \
   --repeats 10 --profiled 1 --top 8 --modes FULL_DECODE_ONLY FULL_AND_PIECEWISE FULL_DECODE_ONLY FULL_AND_PIECEWISE \
   --json $OUT/prefill-w4a16.json >> $log 2>&1)
say "prefill_host done"
grep -E "TTFT|piecewise graphs|passed|failed|Error" $log | head -60
