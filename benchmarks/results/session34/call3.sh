# session 34, call 3 (the session's final code): every GPU test of tests/runtime (but the server and
# structured-output modules, whose imports the GPU machine lacks) with the attention, fused-MoE, sampling and
# GPU-format tests, while the bf16 8B-shaped artifact builds; then time to first token on it with the prefill
# step eager (FULL_DECODE_ONLY), through the piecewise graphs (whose rotary kernel now writes q into the static
# buffer, no copy after it) and through FULL's whole graphs, alternating. One log.
source benchmarks/results/session27/artifacts.sh
log=$OUT/call3.log
say() { echo "[$(date +%H:%M:%S) +${SECONDS}s] $*" | tee -a $log; }
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $log
(artifacts bf16 > $work/artifacts.log 2>&1) &
say "gpu tests (artifact building)"
timeout 330 python -P -m pytest -q -p no:cacheprovider -m gpu tests/runtime --ignore=tests/runtime/server \
  --ignore=tests/runtime/test_structured_output.py tests/kernels/test_attention.py tests/kernels/test_fused_moe.py \
  tests/kernels/test_sampling.py tests/quant/test_gpu_formats.py 2>&1 | tail -15 >> $log
say "gpu tests done"
wait
say "built"; grep -E "^time" $work/artifacts.log >> $log
(cd /tmp && timeout 150 python $repo/benchmarks/prefill_host.py $work/bf16=bf16 --prompt-lens 16 128 512 --repeats 10 \
   --modes FULL_DECODE_ONLY FULL_AND_PIECEWISE FULL --json $OUT/prefill-bf16-call3.json 2>&1 | grep -E "ttft|mode|^bf16" | tail -12 >> $log)
say "prefill done"
python - $OUT/prefill-bf16-call3.json <<'PY' | tee -a $log
import json, sys
for key, rows in json.load(open(sys.argv[1]))["results"].items():
    print(key, [(r["prompt_tokens"], r["ttft_ms_median"], r["kernel_ms"], r["kernels_per_request"]) for r in rows])
PY
