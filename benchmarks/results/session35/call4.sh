# session 35, call 4 (the session's final code): every GPU test of tests/runtime (but the server and
# structured-output modules, whose imports the GPU machine lacks) with the attention, fused-MoE, sampling and
# GPU-format tests; call 1's run of the same (with tests/compiler too) ran out of its 360 s.
source benchmarks/gpu_env.sh
log=$OUT/call4.log
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $log
timeout 520 python -P -m pytest -q -p no:cacheprovider -m gpu tests/runtime --ignore=tests/runtime/server \
  --ignore=tests/runtime/test_structured_output.py tests/kernels/test_attention.py tests/kernels/test_fused_moe.py \
  tests/kernels/test_sampling.py tests/quant/test_gpu_formats.py 2>&1 | tail -25 >> $log
echo "[+${SECONDS}s] done" >> $log
