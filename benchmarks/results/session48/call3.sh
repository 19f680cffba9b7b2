# session 48, call 3: the GPU tests under tests/runtime that call 2 did not reach in its 380 s (it stopped inside
# test_memory_plan.py), with their durations
source benchmarks/gpu_env.sh
export PYTHONPATH=$PYTHONPATH:$repo/.gpu_deps:$repo/benchmarks/results/session48
timeout 520 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/runtime/test_memory_plan.py \
  tests/runtime/test_mistral3_vision.py tests/runtime/test_more_families.py tests/runtime/test_olmo2.py \
  tests/runtime/test_overlap.py tests/runtime/test_phi3.py tests/runtime/test_piecewise_graphs.py \
  tests/runtime/test_pooling.py tests/runtime/test_prompt_embeds.py tests/runtime/test_qwen2_vl.py \
  tests/runtime/test_spec_draft.py -v --durations=40 > $OUT/pytest.log 2>&1
grep -E "FAILED|ERROR|passed|failed|^E " $OUT/pytest.log | head -60
tail -45 $OUT/pytest.log
echo "[+${SECONDS}s] tests done"
