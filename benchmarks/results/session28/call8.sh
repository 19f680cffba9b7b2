# session 28, call 8: the GPU tests on the session's final code (engine, FP8 fusion): the runtime's overlap, CUDA-graph
# and memory-plan tests, the sampling and fused-op kernels, the kernel plan and the FP8 model test
source benchmarks/gpu_env.sh
timeout 420 python -P -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_overlap.py tests/runtime/test_cuda_graphs.py \
  tests/runtime/test_memory_plan.py tests/kernels/test_sampling.py tests/kernels/test_fused_ops.py tests/compiler/test_kernel_plan.py \
  "tests/compiler/test_quantized_build.py::test_fp8_linears_take_their_input_quantized_by_the_kernel_before" 2>&1 | tail -4 | tee $OUT/gpu_tests.log
