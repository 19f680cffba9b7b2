# session 44, call 9, on an H200: DeepSeek V2 / V3 (MLA expanded, DeepSeek MoE) on CUDA; Qwen2-VL's GPU tests with the
# float32 tower's TF32 turned off by the runtime (not by the test, as in call 7); the MoE kernel tests on the new tiles
source benchmarks/gpu_env.sh
timeout 400 python -P -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_deepseek.py tests/runtime/test_qwen2_vl.py \
  tests/kernels/test_fused_moe.py tests/runtime/test_mistral3_vision.py 2>&1 | tail -30
echo "[+${SECONDS}s] done"
