# session 29, call 1 (FP8 W8A8): the decode-attention kernel quantizing o's input against the tree before
# (89a8fd4, `git archive 89a8fd4 | tar -x -C .baseline89`, checkpoints/ removed), same call, alternating processes:
# the GPU tests of the change; the FP8 artifact's batch-1 decode (128-token prompt, 256 new tokens, median of 3)
# and its throughput at max_num_seqs 1024 (128/128 x 1000)
source benchmarks/results/session27/artifacts.sh
bash benchmarks/package_dir.sh $repo/.baseline89 /tmp/before
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
(timeout 420 python -P -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_attention.py tests/kernels/test_fused_ops.py \
  tests/compiler/test_quantized_build.py -k "fp8 or rotates or quantizes or rms or silu or cuda" > $OUT/gpu_tests.log 2>&1; echo "exit $?" >> $OUT/gpu_tests.log) &
artifacts fp8
wait; tail -4 $OUT/gpu_tests.log
for round in 1 2; do
  for variant in before:/tmp/before now:/tmp/llmcpkg; do
    v=${variant%%:*}
    (cd /tmp && PYTHONPATH=${variant#*:} timeout 90 python $repo/benchmarks/bench_e2e.py "$work/fp8=fp8-$v-decode-r$round" \
      --parts decode --json $OUT/e2e-fp8-decode-$v-r$round.json 2>&1 | grep -E -- "->|Error|error:")
  done
done
for variant in before:/tmp/before now:/tmp/llmcpkg; do
  v=${variant%%:*}
  (cd /tmp && PYTHONPATH=${variant#*:} timeout 120 python $repo/benchmarks/bench_e2e.py "$work/fp8=fp8-$v-1024-r1@max_num_seqs=1024" \
    --parts throughput --throughput 128x128:1000 --time-limit 60 --json $OUT/e2e-fp8-$v-r1.json 2>&1 | grep -E -- "->|Error|error:")
done
