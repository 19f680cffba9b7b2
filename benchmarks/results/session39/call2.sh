# session 39, call 2, on an H200 (call 1's machine, artifacts already built): batch-1 decode of the 8B-shaped bf16
# artifact without speculation and with its own W4A16 (RTN g128) build as the draft model, k = 2, 3, 4, one process;
# each engine takes 20% of the GPU (a closed engine's memory may stay cached in the process)
source benchmarks/results/session27/artifacts.sh
artifacts bf16 w4a16
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
(cd /tmp && timeout 540 python -P $repo/benchmarks/bench_spec_draft.py $work/bf16 --draft $work/w4a16 --ks 2 3 4 \
  --batch-sizes 1 --tokens 128 --repeats 3 --option gpu_memory_utilization=0.2 --json $OUT/spec_draft_8b.json 2>&1 \
  | grep -E "^B=|Error|error" )
