# session 50, call 4: the GPU cases of the families merged after call 3 (Nemotron-H's MoE blocks, OLMo Hybrid,
# Falcon-H1, Arcee AFM and Apertus) and GLM-4.7-Flash / Mistral 4's (their Mistral 4 registration fixed for
# transformers 5.17), then the fused MoE kernel's relu2 experts on CUDA
source benchmarks/gpu_env.sh
mkdir -p /tmp/gpudeps && tar -xJf .gpu_deps.tar.xz -C /tmp/gpudeps
export PYTHONPATH=$PYTHONPATH:/tmp/gpudeps:$repo/benchmarks/results/session50
timeout 300 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/runtime/test_glm4_moe_lite_mistral4.py \
  tests/runtime/test_nemotron_h_moe.py tests/runtime/test_olmo_hybrid.py tests/runtime/test_falcon_h1.py \
  tests/runtime/test_arcee_apertus.py "tests/kernels/test_fused_moe.py" -k "on_the_gpu or relu2" \
  -v --durations=8 > $OUT/pytest.log 2>&1
grep -E "FAILED|ERROR|PASSED|passed|failed|^E " $OUT/pytest.log | head -50
echo "[+${SECONDS}s] tests done"
