# session 43, call 6, on an H200: cuBLAS's block-scaled GEMM at tiny shapes and float32 (probe_small.py); the diagnosis
# again after the float32 rule; the GPU tests; the kernel table with per-row weight scales up to 64 tokens and the
# quantization's PDL on/off; end to end fp8 against fp8-block
source benchmarks/gpu_env.sh
timeout 60 python -P benchmarks/results/session43/probe_small.py 2>&1 | tail -32
echo "[+${SECONDS}s] probe done"
timeout 150 python -P benchmarks/results/session43/diag_block_gpu.py 2>&1 | grep -E "^(fp8)|Error"
echo "[+${SECONDS}s] diag done"
timeout 120 python -P -m pytest -q -p no:cacheprovider -m gpu tests/quant/test_fp8_block.py tests/kernels/test_fused_ops.py \
  -k "block or group" 2>&1 | grep -E "^E  |passed|failed" | head -20
echo "[+${SECONDS}s] tests done"
timeout 110 python -P benchmarks/bench_fp8_block.py --ms 1 4 16 37 64 256 1024 4096 --json $OUT/bench_fp8_block_call6.json 2>&1 | grep "^|"
echo "[+${SECONDS}s] bench done"
