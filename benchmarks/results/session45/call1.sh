# session 45, call 1, on an H200: the MoE tile sweep for W4A16 experts (MOE_CONFIGS was chosen by reasoning and
# never measured for them; session 44 swept dense, FP8 and block FP8), and the float32 GPU tests of the families
# whose README line still said "not yet run" (Gemma 2, Granite, OLMo 2) on this tree
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 330 python -P benchmarks/bench_moe.py --kinds w4a16 --sweep --json $OUT/bench_moe_w4a16_sweep.json 2>&1 | tail -120
echo "[+${SECONDS}s] sweep done"
timeout 200 python -P -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_gemma2.py tests/runtime/test_granite.py \
  tests/runtime/test_olmo2.py 2>&1 | tail -8
echo "[+${SECONDS}s] done"
