# session 40, call 3, on the same H200 (call 1's artifact): the LoRA kernels reworked after call 2 (the shrink's grid
# over slots, the expand's splits summed once per tile, at most 256 / T splits): the GPU tests, then call 2's cost
# measure again, the torch path beside it in the same process
source benchmarks/gpu_env.sh
repo=$PWD; work=/tmp/s40
timeout 240 python -P -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_lora_triton.py tests/runtime/test_lora_runtime.py \
  2>&1 | tail -4
echo "[+${SECONDS}s] tests done"
(cd /tmp && timeout $((580 - SECONDS)) python -P $repo/benchmarks/bench_lora.py $work/bf16 --adapters 4 --rank 16 --compare-torch \
  --batch-sizes 1 64 --tokens 64 --repeats 3 --option gpu_memory_utilization=0.25 --json $OUT/lora.json 2>&1 \
  | grep -E "^B=|Error|error")
echo "[+${SECONDS}s] done"
