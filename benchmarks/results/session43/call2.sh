# session 43, call 2, on an H200: the GPU tests after the dispatch change (cuBLAS's block-scaled GEMM above 16 tokens,
# the group quantization kernel) and of Mistral 3's vision model; then the kernel table with the new dispatch
source benchmarks/gpu_env.sh
timeout 300 python -P -m pytest -q -p no:cacheprovider -m gpu tests/quant/test_fp8_block.py tests/quant/test_gpu_formats.py \
  tests/kernels/test_fused_ops.py tests/runtime/test_mistral3_vision.py tests/runtime/test_llava.py 2>&1 | tail -25
echo "[+${SECONDS}s] tests done"
timeout 250 python -P benchmarks/bench_fp8_block.py --json $OUT/bench_fp8_block_call2.json 2>&1 | grep "^|"
echo "[+${SECONDS}s] done"
