# session 41, call 3, on an H200: the GPU tests of the LLaVA path (image rows in eager prefill steps, decode graphs
# after), classifiers and embeddings
source benchmarks/gpu_env.sh
pip list 2>/dev/null | grep -i -E "^pillow|^torchvision" || echo "no pillow/torchvision listed"
timeout 400 python -P -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_llava.py tests/runtime/test_classify.py \
  tests/runtime/test_pooling.py 2>&1 | tail -15
echo "[+${SECONDS}s] done"
