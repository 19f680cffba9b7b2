# session 47, call 3, on an H200: DeepSeek's expanded MLA form in chunks of keys merged by log-sum-exp (helper h20: the
# CUDA call is aten._efficient_attention_forward with its log-sum-exp; the context bound gone): the GPU tests, then
# benchmarks/mla_prefill.py at lengths within one chunk (against session 46's one-call SDPA: 8192 tokens V2-Lite
# 2.75 ms, V3 21.5 ms) and past it (V3's chunk is 8192 keys), and 512-query chunks after long cached contexts
source benchmarks/gpu_env.sh
export PYTHONPATH=$PYTHONPATH:$repo/benchmarks/results/session47
timeout 200 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/kernels/test_mla_attention.py \
  tests/runtime/test_deepseek.py -v > $OUT/pytest.log 2>&1
grep -E "FAILED|ERROR|passed|failed|^E " $OUT/pytest.log | head -30
echo "[+${SECONDS}s] tests done"
timeout 300 python -P benchmarks/mla_prefill.py --out $OUT/mla_prefill_chunked.json --lengths 512,2048,8192,16384,32768 \
  --cached 4096,32768 --reps 3 2>&1 | tail -30
echo "[+${SECONDS}s] done"
