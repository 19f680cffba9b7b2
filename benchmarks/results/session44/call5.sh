# session 44, call 5, on an H200 (warm after call 4): Qwen2-VL's cuda generate test failed its logprob bound (2e-3) in
# call 4 with transformers' tokens; how far each logprob is, with CUDA graphs and eager
source benchmarks/gpu_env.sh
sed -i 's/^    assert ours == pytest.approx(logprobs, abs=atol)/    print("DIAG", max(abs(a - b) for a, b in zip(ours, logprobs)), ours, logprobs); assert ours == pytest.approx(logprobs, abs=atol)/' tests/runtime/vision_oracle.py
timeout 150 python -P -m pytest -q -s -p no:cacheprovider -m gpu tests/runtime/test_qwen2_vl.py -k "generate_with_images and qwen2_vl-cuda" 2>&1 | grep -E "^DIAG|passed|failed" | cut -c1-400
sed -i 's/gpu_memory_utilization=0.3)$/gpu_memory_utilization=0.3, enforce_eager=True)/' tests/runtime/test_qwen2_vl.py
echo "[+${SECONDS}s] eager:"
timeout 150 python -P -m pytest -q -s -p no:cacheprovider -m gpu tests/runtime/test_qwen2_vl.py -k "generate_with_images and qwen2_vl-cuda" 2>&1 | grep -E "^DIAG|passed|failed" | cut -c1-400
echo "[+${SECONDS}s] done"
