# session 38, call 3: the GPU tests on the session's final code (OLMo 2's float32 run on CUDA against transformers,
# its q/k norms through the RMSNorm kernel on strided column slices, every family, the overlap, CUDA graphs,
# piecewise/FULL graphs, attention/sampling/fused-op kernels, GPU formats), as session 37's call 2 ran them
source benchmarks/gpu_env.sh
log=$OUT/call3.log
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $log
timeout 580 python -P -m pytest -q -p no:cacheprovider -m gpu tests/runtime --ignore=tests/runtime/server \
  --ignore=tests/runtime/test_structured_output.py tests/kernels/test_attention.py tests/kernels/test_fused_moe.py \
  tests/kernels/test_sampling.py tests/kernels/test_fused_ops.py tests/quant/test_gpu_formats.py 2>&1 | tail -30 >> $log
echo "[+${SECONDS}s] done" >> $log
cat $log
