# session 42, call 2, on an H200: the GPU tests of the new model families (the fused MoE kernel beside a shared
# expert, W4 gpu-layout and FP8 builds against their CPU perplexity), the MoE and fused-kernel tests they touch, and
# the memory plan
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 560 python -P -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_more_families.py \
  tests/kernels/test_fused_moe.py tests/runtime/test_moe_parallel.py tests/runtime/test_memory_plan.py \
  tests/quant/test_gpu_formats.py 2>&1 | tail -15
echo "[+${SECONDS}s] done"
