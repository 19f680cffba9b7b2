# session 34, call 1: issue 12's and 13's end-to-end measures on the final tree of session 33, whose default
# cudagraph_mode became FULL_AND_PIECEWISE (none of these was re-run after that change):
# - 128/128 x 1000 throughput at max_num_seqs 1024, bf16 and FP8 W8A8, the default against FULL_DECODE_ONLY
#   (the engine before the pieces), alternating;
# - W4A16 against bf16 throughput at the build's max_num_seqs 256 (issue 13);
# - profile_step.py at batch 1, 64 and 256 (issue 12's GPU-busy table), bf16 and FP8.
source benchmarks/results/session27/artifacts.sh
log=$OUT/call1.log
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $log
artifacts bf16 fp8 w4a16 2>&1 | tee -a $log
echo "[+${SECONDS}s] built" | tee -a $log
dec='@compilation_config={"cudagraph_mode":"FULL_DECODE_ONLY"}'
for q in bf16 fp8; do
  (cd /tmp && timeout 150 python $repo/benchmarks/bench_e2e.py "$work/$q=$q-pw-1024@max_num_seqs=1024" \
     "$work/$q=$q-dec-1024@max_num_seqs=1024$dec" "$work/$q=$q-pw2-1024@max_num_seqs=1024" \
     --parts throughput --throughput 128x128:1000 --time-limit 60 --json $OUT/e2e-$q-1024.json 2>&1 | grep -E -- "->|Error|error:" | tee -a $log)
  echo "[+${SECONDS}s] $q throughput" | tee -a $log
done
(cd /tmp && timeout 120 python $repo/benchmarks/bench_e2e.py "$work/w4a16=w4a16-256" "$work/bf16=bf16-256" \
  --parts throughput --throughput 128x128:1000 --time-limit 60 --json $OUT/e2e-w4-vs-bf16.json 2>&1 | grep -E -- "->|Error|error:" | tee -a $log)
echo "[+${SECONDS}s] w4 vs bf16" | tee -a $log
for q in bf16 fp8; do
  (cd /tmp && timeout 100 python $repo/benchmarks/profile_step.py $work/$q --batch-sizes 1,64,256 --json $OUT/profile-$q.json 2>&1 \
    | grep '^{' | python -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print('$q', {k: r.get(k) for k in ('batch_size', 'wall_ms', 'kernel_ms', 'gpu_busy', 'host_not_hidden_ms')})" | tee -a $log)
done
echo "[+${SECONDS}s] done" | tee -a $log
