# session 51, call 3: the state kernels with their tiles from call 2's sweep (kernels/recurrent.py): the kernel tests,
# the layer benchmark, the Qwen3.5-9B-shaped decode steps again (call 2's artifact, where the machine still holds it),
# then every hybrid family's GPU case on the final code
source benchmarks/gpu_env.sh
mkdir -p /tmp/gpudeps && tar -xJf .gpu_deps.tar.xz -C /tmp/gpudeps
export PYTHONPATH=$PYTHONPATH:/tmp/gpudeps:$repo/benchmarks/results/session50
timeout 120 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/kernels/test_recurrent.py -q > $OUT/kernels.log 2>&1
tail -2 $OUT/kernels.log; echo "[+${SECONDS}s] kernel tests done"
timeout 200 python -P benchmarks/bench_hybrid.py --json $OUT/layers.json > $OUT/layers.log 2>&1
tail -16 $OUT/layers.log; echo "[+${SECONDS}s] layer bench done"
if [ -d /tmp/q35/bf16 ]; then
  timeout 120 python -P benchmarks/profile_step.py /tmp/q35/bf16 --batch-sizes 1,64,256 --steps 20 --json $OUT/step-triton.json > $OUT/step-triton.log 2>&1
  grep '^{' $OUT/step-triton.log | cut -c1-300; echo "[+${SECONDS}s] triton steps done"
else echo "no artifact left from call 2"; fi
timeout 330 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/runtime/test_nemotron_h_moe.py \
  tests/runtime/test_lfm2.py tests/runtime/test_olmo_hybrid.py tests/runtime/test_falcon_h1.py tests/runtime/test_qwen3_5.py \
  tests/runtime/test_qwen3_5_moe.py tests/runtime/test_granite4_hybrid.py tests/runtime/test_granite4_moe_hybrid.py \
  tests/runtime/test_bamba.py tests/runtime/test_nemotron_h.py -v --durations=12 > $OUT/pytest.log 2>&1
grep -E "FAILED|ERROR|PASSED|passed|failed|^E |s call" $OUT/pytest.log | head -40
echo "[+${SECONDS}s] tests done"
