# session 34, call 2: cudagraph_mode FULL (whole-forward graphs of prefill and mixed steps, runtime/mixed_graphs.py).
# The GPU tests of the graphs, attention and memory plan (while the 8B-shaped artifacts build), then time to first
# token of one short request (prefill_host.py) with FULL_AND_PIECEWISE (the default) against FULL, alternating,
# on W4A16, FP8 W8A8 and bf16; then latency under a steady load on W4A16, the two modes alternating. One log.
source benchmarks/results/session27/artifacts.sh
log=$OUT/call2.log
say() { echo "[$(date +%H:%M:%S) +${SECONDS}s] $*" | tee -a $log; }
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $log
(artifacts w4a16 fp8 bf16 > $work/artifacts.log 2>&1) &
say "gpu tests (artifacts building)"
timeout 300 python -P -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_piecewise_graphs.py \
  tests/runtime/test_cuda_graphs.py tests/runtime/test_memory_plan.py tests/kernels/test_attention.py \
  tests/runtime/test_overlap.py 2>&1 | tail -15 >> $log
say "gpu tests done"
wait
say "built"; grep -E "^time" $work/artifacts.log >> $log
for q in w4a16 fp8 bf16; do
  (cd /tmp && timeout 110 python $repo/benchmarks/prefill_host.py $work/$q=$q --prompt-lens 16 128 512 --repeats 10 \
     --modes FULL_AND_PIECEWISE FULL --json $OUT/prefill-$q.json 2>&1 | grep -vE "^llmc: |INFO|Writing" | tail -12 >> $log)
  say "prefill $q"
done
(cd /tmp && timeout 150 python $repo/benchmarks/interactive_load.py $work/w4a16=w4a16 --rate 8 --requests 120 \
   --modes FULL_AND_PIECEWISE FULL --json $OUT/load-w4a16.json 2>&1 | grep -vE "^llmc: |INFO" | tail -12 >> $log)
say "load done"
cat $log | tail -80
