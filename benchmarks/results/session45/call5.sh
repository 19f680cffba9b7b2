# session 45, call 5, on an H200: the latent-attention kernel case by case (call 4's GPU test failed: outputs ~700x)
source benchmarks/gpu_env.sh
timeout 200 python -P benchmarks/results/session45/mla_debug.py 2>&1 | tail -30
