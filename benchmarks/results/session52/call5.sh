# session 52, call 5: the final kernels (gates in the kernel for decode steps, computed by torch before a prefill;
# kernels/recurrent.GATES_IN_KERNEL) against the code before any of this session's fusion (.before52 = git archive
# e5042fc of the packages): Qwen3.5-9B's DeltaNet and Nemotron-H-8B's Mamba-2 layers (bench_hybrid.py), alternating,
# twice; then the GPU tests of the kernels and of Qwen3.5 and Granite 4.0's hybrid
source benchmarks/gpu_env.sh
bash benchmarks/package_dir.sh $repo/.before52 /tmp/llmcpkg_before
mkdir -p /tmp/gpudeps && tar -xJf .gpu_deps.tar.xz -C /tmp/gpudeps
NOW=$PYTHONPATH
for round in 1 2; do
  for variant in before now; do
    if [ $variant = before ]; then P=/tmp/llmcpkg_before; else P=$NOW; fi
    PYTHONPATH=$P timeout 100 python -P benchmarks/bench_hybrid.py --layers deltanet mamba2 \
      --json $OUT/layer-$variant-$round.json > /dev/null 2>$OUT/err-$variant-$round.txt
    python3 -c "import json,sys;[print('$variant', r['layer'], r['case'], r['torch_us'], r['triton_us']) for r in json.load(open('$OUT/layer-$variant-$round.json'))['rows']]"
    echo "[+${SECONDS}s] $variant round $round done"
  done
done
rm -f $OUT/err-*.txt
export PYTHONPATH=$PYTHONPATH:/tmp/gpudeps:$repo/benchmarks/results/session50
timeout 300 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/kernels/test_recurrent.py \
  tests/runtime/test_qwen3_5.py tests/runtime/test_granite4_hybrid.py -v --durations=3 > $OUT/pytest.log 2>&1
grep -E "FAILED|ERROR|passed|failed|^E |s call" $OUT/pytest.log | head -30
echo "[+${SECONDS}s] tests done"
