# session 52, call 1: the state kernels' tiles with float32 and with bfloat16 recurrent states (bench_hybrid.py --sweep,
# same run), then the GPU tests of 16-bit states (the kernels at real widths in float64; Qwen3.5 and Bamba engines on
# CUDA against the CPU engine with the same state dtypes)
source benchmarks/gpu_env.sh
mkdir -p /tmp/gpudeps && tar -xJf .gpu_deps.tar.xz -C /tmp/gpudeps
export PYTHONPATH=$PYTHONPATH:/tmp/gpudeps:$repo/benchmarks/results/session50
for dtype in float32 bfloat16; do
  timeout 150 python -P benchmarks/bench_hybrid.py --sweep --state-dtype $dtype --json $OUT/sweep-$dtype.json > $OUT/sweep-$dtype.log 2>&1
  tail -2 $OUT/sweep-$dtype.log; echo "[+${SECONDS}s] sweep $dtype done"
done
timeout 240 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/kernels/test_recurrent.py \
  tests/runtime/test_qwen3_5.py tests/runtime/test_bamba.py -k "recurrent or 16_bit or bfloat16" -v --durations=4 \
  > $OUT/pytest.log 2>&1
grep -E "FAILED|ERROR|passed|failed|^E |s call" $OUT/pytest.log | head -30
echo "[+${SECONDS}s] tests done"
