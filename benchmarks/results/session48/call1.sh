# session 48, call 1: every GPU test outside tests/kernels (runtime, compiler, quant), EAGLE's HeadGraphs refactor
# (session 47, never captured on a real GPU) and Qwen2-VL videos on CUDA first
source benchmarks/gpu_env.sh
export PYTHONPATH=$PYTHONPATH:$repo/.gpu_deps:$repo/benchmarks/results/session48
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
# test_structured_output.py imports jsonschema, which the device lacks
first="tests/runtime/test_eagle_graphs.py tests/runtime/test_eagle_absorb_graphs.py tests/runtime/test_spec_eagle.py
  tests/runtime/test_qwen2_vl_video.py"
[ -n "$SKIP_FIRST" ] || timeout 200 python -P -m pytest -p no:cacheprovider -p printfail -m gpu $first -v > $OUT/pytest_first.log 2>&1
grep -E "FAILED|ERROR|passed|failed|^E " $OUT/pytest_first.log | head -30
echo "[+${SECONDS}s] first done"
timeout 380 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/runtime tests/compiler tests/quant \
  --ignore=tests/runtime/server --ignore=tests/runtime/test_structured_output.py $(for f in $first; do echo --ignore=$f; done) -v --durations=15 > $OUT/pytest.log 2>&1
grep -E "FAILED|ERROR|passed|failed|^E " $OUT/pytest.log | head -60
tail -22 $OUT/pytest.log
echo "[+${SECONDS}s] tests done"
