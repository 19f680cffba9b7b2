# session 50, call 1: the hybrid families' GPU cases never run before (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, Granite 4.0
# attention-only and hybrid: decode graphs reading the state slots), MiniMax-M2's GPU test in its new form (CUDA
# against the CPU path), then tests/kernels' -m gpu files
source benchmarks/gpu_env.sh
mkdir -p /tmp/gpudeps && tar -xJf .gpu_deps.tar.xz -C /tmp/gpudeps
export PYTHONPATH=$PYTHONPATH:/tmp/gpudeps:$repo/benchmarks/results/session50
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 300 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/runtime/test_qwen3_5.py \
  tests/runtime/test_qwen3_5_moe.py tests/runtime/test_granite4_hybrid.py tests/runtime/test_granitemoehybrid.py \
  tests/runtime/test_minimax_m2.py -v --durations=10 > $OUT/pytest.log 2>&1
grep -E "FAILED|ERROR|passed|failed|^E " $OUT/pytest.log | head -40
tail -16 $OUT/pytest.log
echo "[+${SECONDS}s] hybrid tests done"
timeout $((560 - SECONDS)) python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/kernels -q \
  --durations=10 > $OUT/kernels.log 2>&1
grep -E "FAILED|ERROR|passed|failed|^E " $OUT/kernels.log | head -30
tail -14 $OUT/kernels.log
echo "[+${SECONDS}s] kernel tests done"
