# session 44, call 10, on an H200 (warm after call 9): the MoE CUDA-graph test, whose hand-made MoE lacked DeepSeek's
# new router attribute in call 9 (call 9: DeepSeek V2/V3 on CUDA, Qwen2-VL with the runtime's TF32 switch: passed)
source benchmarks/gpu_env.sh
timeout 120 python -P -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_fused_moe.py -k captures 2>&1 | tail -3
