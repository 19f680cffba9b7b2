# session 47, call 1, on an H200: session 46's GPU work that never ran on a GPU: gpt-oss against transformers with
# the SwiGLU values its config gives (tests/conftest.py honour_swiglu_config: the device's transformers 5.17
# hard-codes 1.702 / 7.0), the biased fused MoE, the GGUF Q4_0 tolerance, the MLA split's in-place merge and DeepSeek;
# then the memory plan against a real capture on a DeepSeek-V2-Lite-shaped artifact (4 layers, bf16)
source benchmarks/gpu_env.sh
export PYTHONPATH=$PYTHONPATH:$repo/.gpu_deps:$repo/benchmarks/results/session47
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 300 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/runtime/test_gpt_oss.py \
  tests/kernels/test_fused_moe.py tests/compiler/test_gguf.py tests/kernels/test_mla_attention.py \
  tests/runtime/test_deepseek.py -v > $OUT/pytest.log 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|^E " $OUT/pytest.log | head -80
echo "[+${SECONDS}s] tests done"
cd /tmp && timeout 150 python -P $repo/benchmarks/make_checkpoint.py --out /tmp/dsv2lite --arch deepseek-v2-lite 2>&1 | tail -2
echo "[+${SECONDS}s] checkpoint"
for opts in "" "--max-num-seqs 256 --max-model-len 32768"; do
  timeout 200 python -P $repo/benchmarks/memory_check.py --model /tmp/dsv2lite $opts \
    --json $OUT/memory_check_dsv2lite${opts:+_256x32k}.json 2>&1 | tail -16
  echo "[+${SECONDS}s] memory_check $opts"
done
