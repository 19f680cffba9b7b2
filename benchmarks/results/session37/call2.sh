# session 37, call 2: after Gemma 3, Phi-3 LongRoPE, the LoRA merge and the Responses API merged: the GPU tests
# of call 1's set again (every family's float32 artifact on CUDA against transformers, Phi-3 included), plus
# Gemma 3's GPU tests (float32 against transformers; bf16 W4A16 and FP8 against the CPU), the fused-op kernels
# (GELU-tanh) and piecewise graphs
source benchmarks/gpu_env.sh
log=$OUT/call2.log
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $log
timeout 570 python -P -m pytest -q -p no:cacheprovider -m gpu tests/runtime --ignore=tests/runtime/server \
  --ignore=tests/runtime/test_structured_output.py tests/kernels/test_attention.py tests/kernels/test_fused_moe.py \
  tests/kernels/test_sampling.py tests/kernels/test_fused_ops.py tests/quant/test_gpu_formats.py 2>&1 | tail -30 >> $log
echo "[+${SECONDS}s] done" >> $log
