# session 51, call 1: the state layers' Triton kernels (kernels/recurrent_triton.py) on CUDA: their kernel tests, the
# layer benchmark against the torch path (benchmarks/bench_hybrid.py), then every hybrid family's GPU case (CUDA, now
# on the kernels, against the CPU path / transformers)
source benchmarks/gpu_env.sh
mkdir -p /tmp/gpudeps && tar -xJf .gpu_deps.tar.xz -C /tmp/gpudeps
export PYTHONPATH=$PYTHONPATH:/tmp/gpudeps:$repo/benchmarks/results/session50
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 120 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/kernels/test_recurrent.py -q > $OUT/kernels.log 2>&1
tail -5 $OUT/kernels.log; echo "[+${SECONDS}s] kernel tests done"
timeout 200 python -P benchmarks/bench_hybrid.py --json $OUT/layers.json > $OUT/layers.log 2>&1
tail -18 $OUT/layers.log; echo "[+${SECONDS}s] layer bench done"
timeout 240 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/runtime/test_qwen3_5.py \
  tests/runtime/test_qwen3_5_moe.py tests/runtime/test_granite4_hybrid.py tests/runtime/test_granite4_moe_hybrid.py \
  tests/runtime/test_bamba.py tests/runtime/test_nemotron_h.py tests/runtime/test_nemotron_h_moe.py \
  tests/runtime/test_lfm2.py tests/runtime/test_olmo_hybrid.py tests/runtime/test_falcon_h1.py \
  -v --durations=8 > $OUT/pytest.log 2>&1
grep -E "FAILED|ERROR|PASSED|passed|failed|^E " $OUT/pytest.log | head -40
echo "[+${SECONDS}s] tests done"
