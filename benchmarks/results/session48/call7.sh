# session 48, call 7: the memory plan's new start-up check (memory held by another tensor of the process refused in one
# line, gc.collect before measuring), then call 6's structured-output case again after the Qwen3-VL video test
source benchmarks/gpu_env.sh
export PYTHONPATH=$PYTHONPATH:$repo/.gpu_deps:$repo/benchmarks/results/session48
timeout 200 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/runtime/test_memory_plan.py \
  tests/runtime/test_qwen3_vl_video.py tests/runtime/test_structured_output.py -v > $OUT/pytest.log 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|^E " $OUT/pytest.log | head -30
echo "[+${SECONDS}s] tests done"
