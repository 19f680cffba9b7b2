# session 50, call 3: this session's new families' GPU cases (Granite 4.0's MoE hybrid, Bamba, Nemotron-H, LFM2,
# LFM2-MoE, GLM-4.7-Flash and Mistral 4, GLM-4.7-Flash's MTP), Granite 4.0's hybrid in its new form (against the CPU
# path), then the CUDA-graph and piecewise-graph tests (the decoder's layers without an MLP / without a mixer and the
# relu2 MLP are new branches of the module they capture)
source benchmarks/gpu_env.sh
mkdir -p /tmp/gpudeps && tar -xJf .gpu_deps.tar.xz -C /tmp/gpudeps
export PYTHONPATH=$PYTHONPATH:/tmp/gpudeps:$repo/benchmarks/results/session50
timeout 330 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/runtime/test_granite4_hybrid.py \
  tests/runtime/test_granite4_moe_hybrid.py tests/runtime/test_bamba.py tests/runtime/test_nemotron_h.py \
  tests/runtime/test_lfm2.py tests/runtime/test_lfm2_moe.py tests/runtime/test_glm4_moe_lite_mistral4.py \
  tests/runtime/test_spec_mtp_glm4_moe_lite.py -v --durations=10 > $OUT/pytest.log 2>&1
grep -E "FAILED|ERROR|PASSED|passed|failed|^E " $OUT/pytest.log | head -50
echo "[+${SECONDS}s] family tests done"
timeout $((540 - SECONDS)) python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/runtime/test_cuda_graphs.py \
  tests/runtime/test_piecewise_graphs.py -q --durations=5 > $OUT/graphs.log 2>&1
grep -E "FAILED|ERROR|passed|failed|^E " $OUT/graphs.log | head -30
echo "[+${SECONDS}s] graph tests done"
