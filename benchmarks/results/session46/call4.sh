# session 46, call 4, on an H200: DeepSeek's expanded prefill on CUDA (helper h17's change): the absorbed kernel
# against the expanded path at V2-Lite's and V3's attention shapes (benchmarks/mla_prefill.py: where the rule's
# threshold of 128 queries should be), then the MLA kernel and DeepSeek GPU tests
source benchmarks/gpu_env.sh
export PYTHONPATH=$PYTHONPATH:$repo/benchmarks/results/session46
timeout 200 python -P benchmarks/mla_prefill.py --out $OUT/mla_prefill.json --lengths 32,64,128,512,2048,8192 --reps 5 2>&1 | tail -40
echo "[+${SECONDS}s] bench done"
timeout 200 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/kernels/test_mla_attention.py \
  tests/runtime/test_deepseek.py -v > $OUT/pytest.log 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|^E " $OUT/pytest.log | head -40
echo "[+${SECONDS}s] done"
