# session 45, call 7, on an H200: the decode graphs' capture clears the warm-up's per-step kernel cache (call 6: the
# latent-MLA decode graph read the warm-up's row index after it was freed: an illegal address); DeepSeek on CUDA,
# the GGUF Q4_0 import on CUDA, the CUDA-graph tests
source benchmarks/gpu_env.sh
export PYTHONPATH=$PYTHONPATH:$repo/.gpu_deps:$repo/benchmarks/results/session45
timeout 170 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/runtime/test_deepseek.py \
  tests/compiler/test_gguf.py tests/runtime/test_cuda_graphs.py -v > $OUT/pytest.log 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|=== FAILED|^E " $OUT/pytest.log | head -40
