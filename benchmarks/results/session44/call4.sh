# session 44, call 4, on an H200: the GPU tests of the block-FP8 norm / act · mul quantization, Qwen2-VL / Qwen2.5-VL
# (M-RoPE) and the MoE shared expert's block path; then the fused-vs-unfused pair timings (bench_fp8_block --fused)
source benchmarks/gpu_env.sh
timeout 330 python -P -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_fp8_block_fused.py tests/quant/test_fp8_block.py \
  tests/runtime/test_qwen2_vl.py tests/kernels/test_fused_moe.py \
  "tests/runtime/test_more_families.py::test_quantized_shared_expert_models_on_the_gpu" 2>&1 | tail -30
echo "[+${SECONDS}s] tests done"
timeout 150 python -P benchmarks/bench_fp8_block.py --fused --json $OUT/bench_fp8_block_fused_call4.json 2>&1 | grep -v "^\s*$" | tail -30
echo "[+${SECONDS}s] done"
