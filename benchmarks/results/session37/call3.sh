# session 37, call 3: after Gemma 2 (attention soft-capping in every Triton attention kernel behind a constexpr,
# 0 for every other model): the attention kernels' GPU tests (softcap cases included), every family on CUDA
# against transformers, Gemma 2's and 3's GPU tests, CUDA graphs (piecewise, FULL), the overlapped engine
source benchmarks/gpu_env.sh
log=$OUT/call3.log
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $log
timeout 560 python -P -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_attention.py \
  tests/runtime/test_gemma2.py tests/runtime/test_gemma3.py tests/runtime/test_hf_equivalence.py \
  tests/runtime/test_piecewise_graphs.py tests/runtime/test_cuda_graphs.py tests/runtime/test_overlap.py \
  tests/runtime/test_mixed_graphs_fuzz.py 2>&1 | tail -30 >> $log
echo "[+${SECONDS}s] done" >> $log
