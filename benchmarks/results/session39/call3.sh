# session 39, call 3: the GPU tests of the merged per-token quantization kernel (FP8 and int8 from one kernel):
# the int8 kernels against the torch path bit for bit, the FP8 fused ops and quantization, every GPU format,
# the FP8 model-level tests; then the draft-model and overlap GPU tests once more on the final tree
source benchmarks/gpu_env.sh
log=$OUT/call3.log
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $log
timeout 560 python -P -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_int8_triton.py tests/kernels/test_fused_ops.py \
  tests/quant/test_gpu_formats.py tests/quant/test_fp8.py tests/kernels/test_fused_moe.py tests/runtime/test_spec_draft.py \
  2>&1 | tail -15 >> $log
echo "[+${SECONDS}s] done" >> $log
cat $log
