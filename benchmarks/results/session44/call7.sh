# session 44, call 7, on an H200 (warm after call 6): call 6 with cuDNN's TF32 off (torch.backends.cudnn.allow_tf32, on by
# default: the towers' patch convolutions); if the image requests then agree as text-only ones do, the tower's Conv3d is
# what moved them
source benchmarks/gpu_env.sh
sed -i 's/^    assert ours == pytest.approx(logprobs, abs=atol)/    print("DIAG", max(abs(a - b) for a, b in zip(ours, logprobs)))/' tests/runtime/vision_oracle.py
sed -i 's/^import pytest$/import pytest\nimport torch as _t; _t.backends.cudnn.allow_tf32 = False/' tests/runtime/test_qwen2_vl.py
timeout 200 python -P -m pytest -q -s -p no:cacheprovider -m gpu tests/runtime/test_qwen2_vl.py -k "generate_with_images and cuda" 2>&1 | grep -E "^DIAG|passed|failed|Error" | cut -c1-300
echo "[+${SECONDS}s] done"
