# session 29, call 3 (same warm H100 as call 2, this tree with the probe): the FP8 W8A8 artifact at max_num_seqs 1024
# with an FP8 KV cache (scales 1.0) and with the model-dtype cache, 128/128 x 1000
source benchmarks/results/session27/artifacts.sh >/dev/null 2>&1; ls $work; for v in kvfp8-1024:kv_cache_dtype=fp8,max_num_seqs=1024 kvauto-1024:max_num_seqs=1024; do (cd /tmp && timeout 120 python $repo/benchmarks/bench_e2e.py "$work/fp8=fp8-${v%%:*}@${v#*:}" --parts throughput --throughput 128x128:1000 --time-limit 60 --json $OUT/e2e-fp8-${v%%:*}.json 2>&1 | grep -E -- "->|Error|error:"); done
