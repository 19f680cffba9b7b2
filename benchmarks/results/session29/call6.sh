# session 29, call 6: an e4m3 V tile read as byte pairs and widened in registers before shared memory (probe switch
# attention_triton.FP8_V_PAIRS, env LLMC_FP8_V_PAIRS): the GPU tests with it on, the kernel on the sweep's shapes
# with it off and on, then the FP8 W8A8 artifact with an FP8 KV cache at max_num_seqs 1024, alternating
source benchmarks/results/session27/artifacts.sh
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
(LLMC_FP8_V_PAIRS=1 timeout 200 python -P -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_attention.py > $OUT/gpu_tests.log 2>&1
 echo "exit $?" >> $OUT/gpu_tests.log
 for vp in 0 1; do
   LLMC_FP8_V_PAIRS=$vp python -P benchmarks/decode_attention_sweep.py --caches float8_e4m3fn --block-n 32 64 --warps 4 \
     --stages 3 5 --json $OUT/sweep-vpairs$vp.json > $OUT/sweep-vpairs$vp.log 2>&1
 done) &
artifacts fp8
wait; tail -2 $OUT/gpu_tests.log; grep default $OUT/sweep-vpairs*.log; grep -h "^   " $OUT/sweep-vpairs*.log
for round in 1 2; do
  for vp in 0 1; do
    (cd /tmp && LLMC_FP8_V_PAIRS=$vp timeout 120 python $repo/benchmarks/bench_e2e.py "$work/fp8=fp8-kvfp8-vpairs$vp-r$round@kv_cache_dtype=fp8,max_num_seqs=1024" \
      --parts throughput --throughput 128x128:1000 --time-limit 60 --json $OUT/e2e-kvfp8-vpairs$vp-r$round.json 2>&1 | grep -E -- "->|Error|error:")
  done
done
