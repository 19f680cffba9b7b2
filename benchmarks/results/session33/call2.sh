#!/usr/bin/env bash
# Session 33, call 2: the piecewise graphs' GPU tests (after call 1's fix of one test's count), then one short
# request's TTFT on 8B-shaped bf16 and FP8 W8A8 artifacts, the prefill step eager (FULL_DECODE_ONLY) and
# through the pieces (FULL_AND_PIECEWISE); bf16's pieces loaded twice (the second capture with Triton's
# cache warm). One log.
set -u
source benchmarks/gpu_env.sh
repo=$PWD
work=/tmp/w33; mkdir -p $work/recipes
log=$OUT/call2.log
say() { echo "[$(date +%H:%M:%S) +${SECONDS}s] $*" | tee -a $log; }
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader | tee -a $log
(cd /tmp && python $repo/benchmarks/make_checkpoint.py --out $work/ckpt > $work/ckpt.log 2>&1)
say "checkpoint written"
for kind in bf16 fp8; do
  q='{method: none}'; [ $kind = fp8 ] && q='{method: fp8}'
  cat > $work/recipes/$kind.yaml <<EOR
model: $work/ckpt
output: $work/$kind
dtype: bfloat16
quantization: $q
runtime: {max_model_len: 4096, max_num_seqs: 256, max_num_batched_tokens: 8192}
target: {device: cuda, gpu_memory_gib: 80}
EOR
done
(cd /tmp && python -m llmc.cli build $work/recipes/bf16.yaml -q > $work/build-bf16.log 2>&1; \
 python -m llmc.cli build $work/recipes/fp8.yaml -q > $work/build-fp8.log 2>&1) &
say "gpu tests (builds running)"
timeout 200 python -P -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_piecewise_graphs.py \
  tests/kernels/test_attention.py 2>&1 | tail -8 >> $log
say "gpu tests done"
wait
say "builds done"; tail -1 $work/build-bf16.log $work/build-fp8.log >> $log
(cd /tmp && timeout 200 python $repo/benchmarks/prefill_host.py $work/bf16=bf16 --prompt-lens 16 128 512 \
   --repeats 10 --profiled 1 --top 8 --modes FULL_DECODE_ONLY FULL_AND_PIECEWISE FULL_AND_PIECEWISE \
   --json $OUT/prefill-bf16.json >> $log 2>&1)
say "bf16 done"
(cd /tmp && timeout 150 python $repo/benchmarks/prefill_host.py $work/fp8=fp8 --prompt-lens 16 128 512 \
   --repeats 10 --profiled 1 --top 8 --modes FULL_DECODE_ONLY FULL_AND_PIECEWISE \
   --json $OUT/prefill-fp8.json >> $log 2>&1)
say "fp8 done"
grep -E "TTFT|piecewise graphs|passed|failed|Error|built|time " $log | head -60
