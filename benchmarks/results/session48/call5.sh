# session 48, call 5: SmolLM3 and Qwen3-VL-MoE (h25, h27) on CUDA (-m gpu; the Triton rotary kernel's identity table
# too), then bench_8b.sh glm4-moe again (2 of GLM-4.5-Air's layers) with layer 0's down at group 64 for W4A16
source benchmarks/gpu_env.sh
export PYTHONPATH=$PYTHONPATH:$repo/.gpu_deps:$repo/benchmarks/results/session48
timeout 200 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/runtime/test_smollm3.py \
  tests/runtime/test_qwen3_vl_moe.py tests/kernels/test_attention.py -k "smollm3 or qwen3_vl_moe or identity_table or rotate_and_write" -v > $OUT/pytest.log 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|^E " $OUT/pytest.log | head -30
echo "[+${SECONDS}s] tests done"
CKPT_ARGS="--layers 2" STAGE_LIMIT_S=300 timeout 380 bash benchmarks/bench_8b.sh glm4-moe $OUT 2>&1 | grep -v "it/s" | tail -22
echo "[+${SECONDS}s] glm4-moe done"
