#!/usr/bin/env bash
# Session 33, call 3: the GPU tests of the engine after the piecewise graphs' review fixes, the sampler changes
# and the MoE refactor; then latency under a steady arrival of requests (benchmarks/interactive_load.py) on an
# 8B-shaped bf16 artifact, FULL_DECODE_ONLY (prefill and mixed steps eager) against FULL_AND_PIECEWISE,
# alternating, two rounds. One log.
set -u
source benchmarks/gpu_env.sh
repo=$PWD
work=/tmp/w33; mkdir -p $work/recipes
log=$OUT/call3.log
say() { echo "[$(date +%H:%M:%S) +${SECONDS}s] $*" | tee -a $log; }
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader | tee -a $log
(cd /tmp && python $repo/benchmarks/make_checkpoint.py --out $work/ckpt > $work/ckpt.log 2>&1
 cat > $work/recipes/bf16.yaml <<EOR
model: $work/ckpt
output: $work/bf16
dtype: bfloat16
quantization: {method: none}
runtime: {max_model_len: 4096, max_num_seqs: 256, max_num_batched_tokens: 8192}
target: {device: cuda, gpu_memory_gib: 80}
EOR
 python -m llmc.cli build $work/recipes/bf16.yaml -q > $work/build-bf16.log 2>&1) &
say "gpu tests (checkpoint and build running)"
timeout 280 python -P -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_piecewise_graphs.py \
  tests/runtime/test_cuda_graphs.py tests/runtime/test_overlap.py tests/runtime/test_memory_plan.py \
  tests/kernels/test_fused_moe.py tests/kernels/test_sampling.py 2>&1 | tail -12 >> $log
say "gpu tests done"
wait
say "build done"; tail -1 $work/build-bf16.log >> $log
(cd /tmp && timeout 230 python $repo/benchmarks/interactive_load.py $work/bf16=bf16 --rate 8 --requests 120 \
   --modes FULL_DECODE_ONLY FULL_AND_PIECEWISE FULL_DECODE_ONLY FULL_AND_PIECEWISE --json $OUT/load-bf16.json >> $log 2>&1)
say "load done"
grep -E "passed|failed|Error|ttft|^\[" $log | head -40
