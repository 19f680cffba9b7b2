#!/usr/bin/env bash
# Session 30, calls 1-2: issue 13's kernel table for every W4A16 weight kind (zero points or not, group 128
# or per channel, bf16 or fp16 activations), each against torch's F.linear in its own activation dtype,
# one process per variant so that a cut-off call keeps what finished. The default variant first.
#   call 1: VARIANTS="sym-g128-bf16 asym-g128-bf16 sym-channel-bf16 asym-channel-bf16" bash .../call1.sh
#   call 2: VARIANTS="sym-g128-fp16 asym-g128-fp16 sym-channel-fp16 asym-channel-fp16" bash .../call1.sh
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
for v in $VARIANTS; do
  start=$(date +%s)
  (cd /tmp && timeout 170 python $OLDPWD/benchmarks/bench_kernels.py --variants $v --out $OUT/$v > $OUT/$v.log 2>&1)
  echo "$v rc=$? $(( $(date +%s) - start )) s"; tail -1 $OUT/$v.log
done
