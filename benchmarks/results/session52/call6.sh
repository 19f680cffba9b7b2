# session 52, call 6: every hybrid family's GPU case on the final code (the families calls 3-5 did not run on it)
source benchmarks/gpu_env.sh
mkdir -p /tmp/gpudeps && tar -xJf .gpu_deps.tar.xz -C /tmp/gpudeps
export PYTHONPATH=$PYTHONPATH:/tmp/gpudeps:$repo/benchmarks/results/session50
for files in "tests/runtime/test_lfm2.py tests/runtime/test_olmo_hybrid.py tests/runtime/test_bamba.py" \
             "tests/runtime/test_nemotron_h.py tests/runtime/test_falcon_h1.py tests/runtime/test_qwen3_5_moe.py" \
             "tests/runtime/test_granite4_moe_hybrid.py tests/runtime/test_nemotron_h_moe.py tests/runtime/test_lfm2_moe.py"; do
  timeout 150 python -P -m pytest -p no:cacheprovider -p printfail -m gpu $files -q >> $OUT/pytest.log 2>&1
  grep -E "FAILED|ERROR|passed|failed" $OUT/pytest.log | tail -3; echo "[+${SECONDS}s] $files"
done
