# session 43, call 8, on an H200 (warm after call 7): diag_block_gpu.py --bf16, what a bf16 build's GPU logits are against the CPU's
source benchmarks/gpu_env.sh; timeout 170 python -P benchmarks/results/session43/diag_block_gpu.py --bf16 2>&1 | grep -E "^(dense|fp8)|Error"
