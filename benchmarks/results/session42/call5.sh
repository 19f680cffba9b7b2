# session 42, call 5, on an H200: diag_fp8.py on dense Qwen2 as float32 and as FP8 with its attention biases zeroed
source benchmarks/gpu_env.sh
timeout 300 python -P benchmarks/results/session42/diag_fp8.py qwen2:float qwen2:nobias qwen2_moe:nobias granite 2>&1 | grep -v Warning | grep "ppl"
