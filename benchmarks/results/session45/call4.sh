# session 45, call 4, on an H200: the GPU tests of this session's merged work: DeepSeek's latent MLA cache (its Triton
# kernel at DeepSeek-V2-Lite's shape against float64, the DeepSeek model tests on CUDA), a GGUF Q4_0 import on CUDA
# against transformers (gguf-py carried in .gpu_deps: the device has no network), and the engine-wide GPU tests the
# latent cache's changes to the runner, the cache allocation and the memory profile touch
source benchmarks/gpu_env.sh
export PYTHONPATH=$PYTHONPATH:$repo/.gpu_deps
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 420 python -P -m pytest -p no:cacheprovider -m gpu -x tests/kernels/test_mla_attention.py \
  tests/runtime/test_deepseek.py tests/compiler/test_gguf.py tests/runtime/test_memory_plan.py \
  tests/runtime/test_piecewise_graphs.py tests/runtime/test_cuda_graphs.py tests/runtime/test_overlap.py \
  tests/runtime/test_spec_draft.py tests/runtime/test_hf_equivalence.py -v > $OUT/pytest.log 2>&1
grep -E "PASSED|FAILED|ERROR|SKIPPED|Fatal|Segmentation|^  File \"/|passed|failed" $OUT/pytest.log | grep -v "site-packages" | head -60
echo "[+${SECONDS}s] done"
