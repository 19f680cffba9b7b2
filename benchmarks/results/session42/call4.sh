# session 42, call 4, on an H200: diag_fp8.py (why the Qwen2-MoE FP8 build's GPU perplexity is 8% off its CPU one)
source benchmarks/gpu_env.sh
timeout 300 python -P benchmarks/results/session42/diag_fp8.py "${@:-qwen2 qwen2_moe granitemoeshared}" 2>&1 | grep -v Warning | tail -20
