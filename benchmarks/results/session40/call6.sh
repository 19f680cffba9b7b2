# session 40, call 6, on call 5's H200: the LoRA kernels against the torch path with one adapter (every request on
# it: one slot per tile) at 1, 16 and 64 requests, and with 4 adapters at 16
source benchmarks/gpu_env.sh
repo=$PWD; work=/tmp/s40
[ -f $work/bf16/manifest.json ] || { echo "no artifact (fresh machine)"; exit 1; }
(cd /tmp && timeout 280 python -P $repo/benchmarks/bench_lora.py $work/bf16 --adapters 1 --rank 16 --compare-torch \
  --batch-sizes 1 16 64 --tokens 64 --repeats 3 --option gpu_memory_utilization=0.25 --json $OUT/lora1.json 2>&1 \
  | grep -E "^B=|Error|error")
echo "[+${SECONDS}s] one adapter done"
(cd /tmp && timeout $((580 - SECONDS)) python -P $repo/benchmarks/bench_lora.py $work/bf16 --adapters 4 --rank 16 --compare-torch \
  --batch-sizes 16 --tokens 64 --repeats 3 --option gpu_memory_utilization=0.25 --json $OUT/lora4_16.json 2>&1 \
  | grep -E "^B=|Error|error")
echo "[+${SECONDS}s] done"
