# session 39, call 4: run-time LoRA on CUDA (float32 tiny Llama, CUDA graphs and piecewise graphs, three adapters
# and the base model in one batch, against transformers + PEFT), and the engine's GPU tests around the code it
# touched (overlap, CUDA / piecewise graphs, memory plan, the draft model)
source benchmarks/gpu_env.sh
log=$OUT/call4.log
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $log
timeout 560 python -P -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_lora_runtime.py tests/runtime/test_overlap.py \
  tests/runtime/test_cuda_graphs.py tests/runtime/test_piecewise_graphs.py tests/runtime/test_memory_plan.py \
  tests/runtime/test_spec_draft.py 2>&1 | tail -25 >> $log
echo "[+${SECONDS}s] done" >> $log
cat $log
