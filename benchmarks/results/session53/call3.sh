# session 53, call 3: the chunked kernels after calls 1-2 (block-wise (I + A)^-1, the output scores P in the parallel
# kernel, tf32 products, the token loop taking a step's short pieces). GPU tests (errors printed), where the time
# goes per dot precision (chunked_probe.py), the sweep against the token loop, one layer's prefill
source benchmarks/gpu_env.sh
timeout 200 python -P -m pytest -p no:cacheprovider -m gpu tests/kernels/test_recurrent.py -q > $OUT/pytest.log 2>&1
grep -E "FAILED|passed|failed|Greatest" $OUT/pytest.log | head -40
echo "[+${SECONDS}s] tests done"
timeout 120 python -P benchmarks/chunked_probe.py 2>&1 | grep -v Warn | tail -12
echo "[+${SECONDS}s] probe done"
timeout 200 python -P benchmarks/bench_hybrid.py --sweep-chunked --json $OUT/sweep.json > $OUT/sweep.log 2>&1
python3 -c "
import json
for r in json.load(open('$OUT/sweep.json'))['sweep']: print(r['kernel'], r['form'], r['case'], r['block'], r['warps'], r['us'])" 2>&1 | cut -c1-100
echo "[+${SECONDS}s] sweep done"
timeout 150 python -P benchmarks/bench_hybrid.py --layers deltanet mamba2 --json $OUT/layer.json 2>&1 | tail -11
echo "[+${SECONDS}s] layers done"
