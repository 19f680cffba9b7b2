# session 49, call 5: MiniMax-M2 on CUDA, where it leaves transformers (minimax_gpu_diag.py), then the GPU cases of
# Llama 4's chunked attention (kernels at Scout's shapes, the long decode and the mid-chunk prefix hit in every graph
# mode)
source benchmarks/gpu_env.sh
export PYTHONPATH=$PYTHONPATH:$repo/benchmarks/results/session49
timeout 100 python -P benchmarks/results/session49/minimax_gpu_diag.py 2>&1 | grep -v "Loading weights" | tail -30
echo "[+${SECONDS}s] diag done"
timeout 170 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/kernels/test_attention_chunked.py \
  tests/runtime/test_llama4.py -v --durations=8 > $OUT/pytest.log 2>&1
grep -E "FAILED|ERROR|passed|failed|^E " $OUT/pytest.log | head -30
tail -12 $OUT/pytest.log
echo "[+${SECONDS}s] tests done"
