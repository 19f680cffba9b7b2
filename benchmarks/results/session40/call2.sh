# session 40, call 2, on the same H200 (call 1's artifact): call 1's GPU tests again (they did not collect there:
# pytest without -P imported the repo's own llmc/ folder), then what run-time LoRA costs with the Triton
# shrink/expand kernels against the torch path (three ops dense over the slots) in the same process, 4 adapters
# of rank 16
source benchmarks/gpu_env.sh
repo=$PWD; work=/tmp/s40
timeout 240 python -P -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_lora_triton.py tests/runtime/test_lora_runtime.py \
  tests/runtime/test_pooling.py 2>&1 | tail -15
echo "[+${SECONDS}s] tests done"
(cd /tmp && timeout $((580 - SECONDS)) python -P $repo/benchmarks/bench_lora.py $work/bf16 --adapters 4 --rank 16 --compare-torch \
  --batch-sizes 1 64 --tokens 64 --repeats 3 --option gpu_memory_utilization=0.25 --json $OUT/lora.json 2>&1 \
  | grep -E "^B=|Error|error")
echo "[+${SECONDS}s] done"
