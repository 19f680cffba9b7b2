# session 42, call 3, on an H200: call 2's failures again with their whole output (the graph test after its fix)
source benchmarks/gpu_env.sh
timeout 300 python -P -m pytest -q -p no:cacheprovider -m gpu -x \
  "tests/runtime/test_more_families.py::test_quantized_shared_expert_models_on_the_gpu" \
  tests/kernels/test_fused_moe.py -k "shared_expert or captures_in_a_cuda_graph" 2>&1 | grep -v "^  warnings\|Warning" | tail -60
