# session 44, call 11, on an H200: GLM-4, Cohere 2 and Cohere float32 artifacts on CUDA against transformers (their
# q/k rows permuted at build so the whole-head rotary kernels rotate GLM's and Cohere's interleaved pairs)
source benchmarks/gpu_env.sh
timeout 200 python -P -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_glm4_cohere.py 2>&1 | tail -15
