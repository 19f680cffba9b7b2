# session 35, call 2: FP8 W8A8 throughput at 128/128 closer to TensorRT-LLM's published protocol (perf-overview:
# 30,000 requests so the run reaches a steady state, CUDA graphs up to batch 8192, its own max batch heuristic)
# than the 1000 requests at max_num_seqs 1024 of every earlier row: 8000 requests (~40 s each) at max_num_seqs
# 1024 (the earlier setting) and 2048, and 2048 with an FP8 KV cache; one process, one artifact, one H200.
source benchmarks/results/session27/artifacts.sh
log=$OUT/call2.log
say() { echo "[$(date +%H:%M:%S) +${SECONDS}s] $*" | tee -a $log; }
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $log
artifacts fp8 > $work/artifacts.log 2>&1
say "built"; grep -E "^time|rror" $work/artifacts.log >> $log
(cd /tmp && timeout 500 python $repo/benchmarks/bench_e2e.py "$work/fp8=fp8-1024@max_num_seqs=1024" \
   "$work/fp8=fp8-2048@max_num_seqs=2048" "$work/fp8=fp8-2048-kv8@max_num_seqs=2048,kv_cache_dtype=fp8" \
   --parts throughput --throughput 128x128:8000 --time-limit 70 --json $OUT/e2e-fp8-8000.json 2>&1 \
   | grep -E -- "->|throughput|Error|error:|CUDA graphs:" | tee -a $log)
say "done"
