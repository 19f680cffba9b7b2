# session 50, call 2: the hybrid families' GPU cases again after call 1's fix (the memory profile's KV cache bound to
# the attention layers alone), the fused-MoE graph test with the router's scoring set, and tests/kernels/test_w4a16.py
# (call 1 ran out of time in it)
source benchmarks/gpu_env.sh
mkdir -p /tmp/gpudeps && tar -xJf .gpu_deps.tar.xz -C /tmp/gpudeps
export PYTHONPATH=$PYTHONPATH:/tmp/gpudeps:$repo/benchmarks/results/session50
timeout 200 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/runtime/test_qwen3_5.py \
  tests/runtime/test_qwen3_5_moe.py tests/runtime/test_granite4_hybrid.py \
  "tests/kernels/test_fused_moe.py::test_runtime_moe_captures_in_a_cuda_graph_and_replays_new_routes" \
  -v --durations=8 > $OUT/pytest.log 2>&1
grep -E "FAILED|ERROR|PASSED|passed|failed|^E " $OUT/pytest.log | head -40
echo "[+${SECONDS}s] hybrid tests done"
timeout $((330 - SECONDS)) python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/kernels/test_w4a16.py -q \
  --durations=10 > $OUT/kernels.log 2>&1
grep -E "FAILED|ERROR|passed|failed|^E " $OUT/kernels.log | head -30
tail -14 $OUT/kernels.log
echo "[+${SECONDS}s] kernel tests done"
