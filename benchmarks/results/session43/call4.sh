# session 43, call 4, on an H200: which token counts cuBLAS's block-scaled GEMM takes (probe_odd_m.py); the block
# build's GPU test with its failure shown; the fp8-block throughput run that failed in call 3, its first error shown
source benchmarks/gpu_env.sh
timeout 60 python -P benchmarks/results/session43/probe_odd_m.py 2>&1 | tail -40
echo "[+${SECONDS}s] probe done"
timeout 120 python -P -m pytest -q -p no:cacheprovider -m gpu -x tests/quant/test_fp8_block.py -k cuda_agrees 2>&1 | grep -E "^E |Error|passed|failed" | head -30
echo "[+${SECONDS}s] test done"
repo=$PWD; work=/tmp/s43
(cd /tmp && timeout 150 python -P $repo/benchmarks/bench_e2e.py $work/fp8block=fp8-block --parts throughput \
  --throughput 128x128:200 --time-limit 20 --json $OUT/e2e_call4.json 2>&1 | grep -v "^\s*$" | grep -B2 -A12 -m3 "Error\|error" | head -80)
echo "[+${SECONDS}s] done"
