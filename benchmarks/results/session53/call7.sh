# session 53, call 7: one layer's prefills and decodes on the final code (bench_hybrid.py: the chunked kernels against
# the token loop, same run; a mixed step of 256 one-token pieces beside one of 512 among the prefills), twice; then
# the kernels' GPU tests
source benchmarks/gpu_env.sh
for round in 1 2; do
  timeout 150 python -P benchmarks/bench_hybrid.py --layers deltanet mamba2 --json $OUT/layer-$round.json 2>&1 | tail -12
  echo "[+${SECONDS}s] round $round done"
done
timeout 150 python -P -m pytest -p no:cacheprovider -m gpu tests/kernels/test_recurrent.py -q > $OUT/pytest.log 2>&1
grep -E "FAILED|passed|failed" $OUT/pytest.log | head
echo "[+${SECONDS}s] tests done"
