# session 45, call 6, on an H200: where the latent-MLA DeepSeek model's CUDA run makes an illegal memory access
# (call 4: test_deepseek.py::test_on_the_gpu), with CUDA_LAUNCH_BLOCKING=1 so the failing launch raises
source benchmarks/gpu_env.sh
CUDA_LAUNCH_BLOCKING=1 timeout 200 python -P -m pytest -p no:cacheprovider -m gpu -x tests/runtime/test_deepseek.py \
  -v > $OUT/pytest.log 2>&1
grep -v "site-packages" $OUT/pytest.log | grep -E "^(tests|E |[a-z_/]+\.py:[0-9]+)|PASSED|FAILED|passed|failed|^    " | head -80
