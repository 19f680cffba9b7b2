# session 44, call 8, on an H200: the MoE tile sweep for per-channel FP8 and bf16 experts (MOE_CONFIGS was chosen by
# reasoning; call 2's block sweep found 64 x 128 tiles of 4 warps 1.3x faster than the table's at 128 Mixtral tokens)
source benchmarks/gpu_env.sh
timeout 300 python -P benchmarks/bench_moe.py --kinds fp8,bf16 --sweep --json $OUT/bench_moe_call8.json 2>&1 | tail -200
echo "[+${SECONDS}s] done"
