# session 43, call 9, on an H200 (the session's last ~220 s): the block build's GPU test in its final form, then the
# float32-on-the-GPU tests of Gemma 2, Granite and OLMo 2 that the README said were never run
source benchmarks/gpu_env.sh
timeout 80 python -P -m pytest -q -p no:cacheprovider -m gpu tests/quant/test_fp8_block.py -k cuda_agrees 2>&1 | grep -E "^E  |passed|failed" | head -8
echo "[+${SECONDS}s] block test done"
timeout 100 python -P -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_gemma2.py tests/runtime/test_granite.py \
  tests/runtime/test_olmo2.py -k float32_on_the_gpu 2>&1 | grep -E "^E  |passed|failed" | head -8
echo "[+${SECONDS}s] done"
