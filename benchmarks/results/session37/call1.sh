# session 37, call 1: the GPU tests of session 35's set (tests/runtime but the server and structured-output
# modules, attention, fused MoE, sampling, GPU formats) on this session's tree: Phi-3 joins every family's
# fixtures, and the new test_every_family_matches_transformers_on_the_gpu runs each family's float32 artifact
# on CUDA against transformers
source benchmarks/gpu_env.sh
log=$OUT/call1.log
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $log
timeout 560 python -P -m pytest -q -p no:cacheprovider -m gpu tests/runtime --ignore=tests/runtime/server \
  --ignore=tests/runtime/test_structured_output.py tests/kernels/test_attention.py tests/kernels/test_fused_moe.py \
  tests/kernels/test_sampling.py tests/quant/test_gpu_formats.py 2>&1 | tail -30 >> $log
echo "[+${SECONDS}s] done" >> $log
