# session 43, call 1, on an H200: the GPU tests of w8a8-fp8-block (the Triton kernel with group scales, the format's
# linear, a block build on CUDA against the CPU) and the FP8 GPU tests the kernel change touches; then the kernel
# benchmark with the tile sweep and torch's block-scaled cuBLAS variants
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 300 python -P -m pytest -q -p no:cacheprovider -m gpu tests/quant/test_fp8_block.py tests/quant/test_gpu_formats.py \
  tests/kernels/test_fused_ops.py 2>&1 | tail -25
echo "[+${SECONDS}s] tests done"
timeout 420 python -P benchmarks/bench_fp8_block.py --json $OUT/bench_fp8_block_call1.json --sweep 2>&1 | tail -40
echo "[+${SECONDS}s] done"
