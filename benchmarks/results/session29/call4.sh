# session 29, call 4: how the decode kernel widens an FP8 KV cache (probe switch attention_triton.FP8_CACHE_CONVERT,
# env LLMC_FP8_CACHE_CONVERT): the kernel alone on the sweep's shapes, then the FP8 W8A8 artifact with an FP8 KV cache
# at max_num_seqs 1024 (128/128 x 1000) in each mode, alternating
source benchmarks/results/session27/artifacts.sh
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
(python -P benchmarks/fp8_cache_convert_probe.py --json $OUT/fp8_cache_convert_probe.json > $OUT/probe.log 2>&1) &
artifacts fp8
wait; cat $OUT/probe.log
for round in 1 2; do
  for mode in 0 1 2; do
    (cd /tmp && LLMC_FP8_CACHE_CONVERT=$mode timeout 120 python $repo/benchmarks/bench_e2e.py "$work/fp8=fp8-kvfp8-mode$mode-r$round@kv_cache_dtype=fp8,max_num_seqs=1024" \
      --parts throughput --throughput 128x128:1000 --time-limit 60 --json $OUT/e2e-kvfp8-mode$mode-r$round.json 2>&1 | grep -E -- "->|Error|error:")
  done
done
