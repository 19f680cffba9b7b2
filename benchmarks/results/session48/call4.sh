# session 48, call 4: GLM-4.5 MoE and Qwen3-VL (h24, h26) on CUDA (-m gpu), then bench_8b.sh glm4-moe with 2 of
# GLM-4.5-Air's layers (1 dense, 1 MoE of 128 experts top-8): bf16 and RTN W4A16 built and served
source benchmarks/gpu_env.sh
export PYTHONPATH=$PYTHONPATH:$repo/.gpu_deps:$repo/benchmarks/results/session48
timeout 200 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/runtime/test_glm4_moe.py \
  tests/runtime/test_qwen3_vl.py -v > $OUT/pytest.log 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|^E " $OUT/pytest.log | head -30
echo "[+${SECONDS}s] tests done"
CKPT_ARGS="--layers 2" STAGE_LIMIT_S=330 timeout 400 bash benchmarks/bench_8b.sh glm4-moe $OUT 2>&1 | tail -22
echo "[+${SECONDS}s] glm4-moe done"
