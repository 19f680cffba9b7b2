# session 43, call 5, on an H200: the block build's GPU disagreement diagnosed (diag_block_gpu.py, PDL on and off);
# the GPU tests after the padded cuBLAS path; the kernel table; end to end again with fp8-block
source benchmarks/gpu_env.sh
timeout 150 python -P benchmarks/results/session43/diag_block_gpu.py 2>&1 | grep -E "^(dense|fp8)|Error"
LLMC_PDL=0 timeout 100 python -P benchmarks/results/session43/diag_block_gpu.py 2>&1 | grep -E "^fp8block|Error"
echo "[+${SECONDS}s] diag done"
timeout 120 python -P -m pytest -q -p no:cacheprovider -m gpu tests/quant/test_fp8_block.py tests/kernels/test_fused_ops.py \
  -k "block or group" 2>&1 | grep -E "^E  |passed|failed" | head -20
echo "[+${SECONDS}s] tests done"
timeout 100 python -P benchmarks/bench_fp8_block.py --ms 1 4 16 37 64 256 1024 4096 --json $OUT/bench_fp8_block_call5.json 2>&1 | grep "^|"
echo "[+${SECONDS}s] bench done"
repo=$PWD; work=/tmp/s43
(cd /tmp && timeout 200 python -P $repo/benchmarks/bench_e2e.py $work/bf16=bf16 $work/fp8=fp8 $work/fp8block=fp8-block \
  --parts decode,throughput --throughput 128x128:1000 --time-limit 40 --json $OUT/e2e_call5.json 2>&1 | grep -E "^\||Error|failed")
echo "[+${SECONDS}s] done"
