# session 48, call 6: MTP speculative decoding (h31), Qwen3-VL videos (h30) and the structured-output GPU test (jsonschema
# now in .gpu_deps) on CUDA
source benchmarks/gpu_env.sh
export PYTHONPATH=$PYTHONPATH:$repo/.gpu_deps:$repo/benchmarks/results/session48
timeout 240 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/runtime/test_spec_mtp.py \
  tests/runtime/test_qwen3_vl_video.py tests/runtime/test_structured_output.py -v > $OUT/pytest.log 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|^E " $OUT/pytest.log | head -30
echo "[+${SECONDS}s] tests done"
