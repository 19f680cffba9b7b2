# session 52, call 4: Mamba-2's time step and gated norm fused into its kernels. The Nemotron-H-8B-shaped Mamba-2
# layer (bench_hybrid.py --layers mamba2: torch path and kernels, decode graphs of 1 / 64 / 256 sequences, prefills)
# on the code before (.before52b = git archive 514e53d of the packages) and now, alternating; then the GPU tests
source benchmarks/gpu_env.sh
bash benchmarks/package_dir.sh $repo/.before52b /tmp/llmcpkg_before
mkdir -p /tmp/gpudeps && tar -xJf .gpu_deps.tar.xz -C /tmp/gpudeps
NOW=$PYTHONPATH
for round in 1 2; do
  for variant in before now; do
    if [ $variant = before ]; then P=/tmp/llmcpkg_before; else P=$NOW; fi
    PYTHONPATH=$P timeout 90 python -P benchmarks/bench_hybrid.py --layers mamba2 --json $OUT/layer-$variant-$round.json \
      > $OUT/layer-$variant-$round.log 2>&1
    grep "^mamba2" $OUT/layer-$variant-$round.log; echo "[+${SECONDS}s] $variant round $round done"
  done
done
export PYTHONPATH=$PYTHONPATH:/tmp/gpudeps:$repo/benchmarks/results/session50
timeout 330 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/kernels/test_recurrent.py \
  tests/runtime/test_granite4_hybrid.py tests/runtime/test_bamba.py tests/runtime/test_falcon_h1.py \
  tests/runtime/test_nemotron_h.py -v --durations=4 > $OUT/pytest.log 2>&1
grep -E "FAILED|ERROR|passed|failed|^E |s call" $OUT/pytest.log | head -30
echo "[+${SECONDS}s] tests done"
