# session 44, call 2, on an H200 (warm after call 1): block-FP8 experts with BLOCK_K = the group (128) in every tile;
# the tile sweep for them; the bf16 kernel test whose bound call 1 found too tight
source benchmarks/gpu_env.sh
timeout 120 python -P -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_fused_moe.py -k block 2>&1 | tail -3
echo "[+${SECONDS}s] tests done"
timeout 400 python -P benchmarks/bench_moe.py --kinds fp8-block --sweep --json $OUT/bench_moe_call2.json 2>&1 | tail -100
echo "[+${SECONDS}s] done"
