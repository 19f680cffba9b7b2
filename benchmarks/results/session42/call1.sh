# session 42, call 1, on an H200: the GPU tests of this session's runtime changes: the prefill kernel's key limits
# (Gemma 3's image tokens) and Gemma 3 vision generation against transformers, prompts given as embeddings with decode
# graphs, LLaVA again, and the graph and overlap tests the model runner's image-row path touches
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 560 python -P -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_attention.py \
  tests/runtime/test_gemma3_vision.py tests/runtime/test_prompt_embeds.py tests/runtime/test_llava.py \
  tests/runtime/test_cuda_graphs.py tests/runtime/test_piecewise_graphs.py tests/runtime/test_overlap.py 2>&1 | tail -15
echo "[+${SECONDS}s] done"
