# session 49, call 3: the GPU cases of this session's families (dots.llm1, ERNIE 4.5 MoE, Ministral 3 and its query
# temperature), the CUDA-graph, piecewise-graph and float32 family tests the temperature's code path runs under, the
# structured-output case (xgrammar from .gpu_deps.tar.xz, the ignored bundle of what the device lacks), then issue
# 12's CPU ratio (benchmarks/cpu_step_ratio.sh on 2 pinned cores of this machine's idle CPU)
source benchmarks/gpu_env.sh
mkdir -p /tmp/gpudeps && tar -xJf .gpu_deps.tar.xz -C /tmp/gpudeps
export PYTHONPATH=$PYTHONPATH:/tmp/gpudeps:$repo/benchmarks/results/session49
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 420 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/runtime/test_dots1.py \
  tests/runtime/test_ernie4_5_moe.py tests/runtime/test_ministral3.py tests/runtime/test_structured_output.py \
  tests/runtime/test_cuda_graphs.py tests/runtime/test_piecewise_graphs.py tests/runtime/test_hf_equivalence.py \
  -v --durations=15 > $OUT/pytest.log 2>&1
grep -E "FAILED|ERROR|passed|failed|^E " $OUT/pytest.log | head -40
tail -22 $OUT/pytest.log
echo "[+${SECONDS}s] tests done"
timeout 150 bash benchmarks/cpu_step_ratio.sh $OUT/cpu 2 > $OUT/cpu.log 2>&1; echo "[+${SECONDS}s] cpu ratio rc $?"
tail -5 $OUT/cpu.log
