# session 44, call 3, on an H200 (warm after call 2): a Qwen3-30B-A3B-shaped model (6 of 48 layers) built bf16, FP8 per
# channel and FP8 in 128 x 128 blocks (its experts now in the fused kernel), decode and 128/128 throughput in one run
CKPT_ARGS="--layers 6" STAGE_LIMIT_S=540 bash benchmarks/bench_8b.sh moe-fp8 $OUT 2>&1 | grep -v "^\[.*\]   \(decode\|throughput\)" | tail -40
