# session 38, call 1: the GPU tests that had never run on a GPU (Granite's float32 run against transformers,
# the partial-rotary refusal by a real CUDA engine), every family's float32 GPU test, and the GPU-vs-CPU
# agreement of Qwen3-MoE beside Llama's (a bf16 Qwen3-MoE was seen far from transformers; session 37's notes)
source benchmarks/gpu_env.sh
log=$OUT/call1.log
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $log
timeout 300 python -P -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_granite.py tests/runtime/test_phi3.py \
  tests/runtime/test_hf_equivalence.py tests/runtime/test_gemma2.py tests/runtime/test_gemma3.py 2>&1 | tail -15 >> $log
echo "[+${SECONDS}s] tests done" >> $log
timeout 240 python -P benchmarks/gpu_cpu_agreement.py --families llama qwen3_moe --out $OUT >> $log 2>&1
echo "[+${SECONDS}s] done" >> $log
cat $log
