# session 46, call 6, on an H200: which part of gpt-oss's fused MoE is wrong on CUDA (moe_bias_probe.py)
source benchmarks/gpu_env.sh
timeout 100 python -P benchmarks/results/session46/moe_bias_probe.py 2>&1 | tail -12
