# session 54, call 1: the review's _read_state / _chunk_rows (session 53, never run on a GPU) under the kernels' and
# the hybrid families' GPU tests; then the chunked kernels' tiles with 8 warps (session 53's offline ptxas: 8 warps cut
# the scan's and the SSD's spills 2-6x; the per-chunk kernel's warps apart, `prep`)
source benchmarks/gpu_env.sh
mkdir -p /tmp/gpudeps && tar -xJf .gpu_deps.tar.xz -C /tmp/gpudeps
export PYTHONPATH=$PYTHONPATH:/tmp/gpudeps:$repo/benchmarks/results/session50
timeout 240 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/kernels/test_recurrent.py \
  tests/runtime/test_qwen3_5.py tests/runtime/test_nemotron_h.py tests/runtime/test_granite4_hybrid.py -q \
  > $OUT/pytest.log 2>&1
grep -E "FAILED|passed|failed|Error" $OUT/pytest.log | head -20
echo "[+${SECONDS}s] tests done"
timeout 240 python -P benchmarks/bench_hybrid.py --sweep-chunked --json $OUT/sweep.json > $OUT/sweep.log 2>&1
python3 -c "
import json
for r in json.load(open('$OUT/sweep.json'))['sweep']: print(r['kernel'], r['form'], r['case'], r['block'], r['warps'], r['us'])" 2>&1 | cut -c1-110
echo "[+${SECONDS}s] sweep done"
