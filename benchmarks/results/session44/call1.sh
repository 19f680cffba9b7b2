# session 44, call 1, on an H200: block-FP8 experts in the fused MoE kernel (GPU tests, then bench_moe against the
# per-expert loop and per-channel FP8); the block build's e2e GPU test and LLaVA-NeXT's GPU test, never run before
source benchmarks/gpu_env.sh
timeout 330 python -P -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_fused_moe.py tests/quant/test_fp8_block.py \
  tests/runtime/test_llava_next.py "tests/runtime/test_more_families.py::test_quantized_shared_expert_models_on_the_gpu" 2>&1 | tail -25
echo "[+${SECONDS}s] tests done"
timeout 220 python -P benchmarks/bench_moe.py --kinds bf16,fp8,fp8-block --json $OUT/bench_moe_call1.json 2>&1 | tail -30
echo "[+${SECONDS}s] done"
