# session 26, call 6: the GPU tests of the engine after the incremental sampler refresh (5dbdc30): overlap (no launch
# waits for the device), CUDA graphs, the memory plan, sampling kernels, the kernel plan
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 500 python -P -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_overlap.py tests/runtime/test_cuda_graphs.py tests/runtime/test_memory_plan.py tests/kernels/test_sampling.py \
  tests/compiler/test_kernel_plan.py 2>&1 | tail -4 | tee $OUT/gpu_tests_runtime.log
