# session 53, call 1: the chunked delta rule and SSD kernels (kernels/recurrent_triton.delta_rule_chunked,
# ssd_chunked). Their GPU tests against float64; the tile / warp sweep against the token loop over piece lengths
# (bench_hybrid.py --sweep-chunked); one layer's prefill, chunked against the token loop, same run (bench_hybrid.py)
source benchmarks/gpu_env.sh
mkdir -p /tmp/gpudeps && tar -xJf .gpu_deps.tar.xz -C /tmp/gpudeps
[ -n "$SKIP_TESTS" ] || timeout 200 python -P -m pytest -p no:cacheprovider -m gpu tests/kernels/test_recurrent.py -q -x > $OUT/pytest.log 2>&1
[ -n "$SKIP_TESTS" ] || grep -E "FAILED|ERROR|passed|failed|^E " $OUT/pytest.log | head -30
echo "[+${SECONDS}s] tests done"
timeout 200 python -P benchmarks/bench_hybrid.py --sweep-chunked --json $OUT/sweep.json > $OUT/sweep.log 2>&1
tail -3 $OUT/sweep.log
python3 -c "
import json
for r in json.load(open('$OUT/sweep.json'))['sweep']: print(r['kernel'], r['form'], r['case'], r['block'], r['warps'], r['us'])"
echo "[+${SECONDS}s] sweep done"
timeout 150 python -P benchmarks/bench_hybrid.py --layers deltanet mamba2 --json $OUT/layer.json 2>&1 | tail -12
echo "[+${SECONDS}s] layers done"
