# session 47, call 6, on an H200: EAGLE's absorb of verify steps from a CUDA graph (helper h22) and the greedy verify
# (greedy_verify: argmax rows, no distributions) — their GPU tests, then the 8B-shaped EAGLE-3 cost again with the
# profile (call 5: k = 1 7.72 ms, k = 3 8.71 ms per step, GPU busy 0.62 / 0.60; 4.53 ms per token without a head)
source benchmarks/gpu_env.sh
export PYTHONPATH=$PYTHONPATH:$repo/benchmarks/results/session47
timeout 150 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/runtime/test_eagle_graphs.py tests/runtime/test_eagle_absorb_graphs.py \
  tests/runtime/test_spec_eagle.py -v > $OUT/pytest.log 2>&1
grep -E "FAILED|ERROR|passed|failed|^E " $OUT/pytest.log | head -30
echo "[+${SECONDS}s] tests done"
work=/tmp/e8b; mkdir -p $work
(cd /tmp && timeout 120 python $repo/benchmarks/make_checkpoint.py --out $work/ckpt > $OUT/ckpt.log 2>&1) || tail -3 $OUT/ckpt.log
sed "s#WORK#$work#" > $work/bf16.yaml <<'YAML'
model: WORK/ckpt
output: WORK/bf16
dtype: bfloat16
quantization: {method: none}
runtime: {max_model_len: 4096, max_num_seqs: 64, max_num_batched_tokens: 8192}
target: {device: cuda, gpu_memory_gib: 141}
YAML
(cd /tmp && timeout 100 python -m llmc.cli build $work/bf16.yaml -q > $OUT/build.log 2>&1) || tail -3 $OUT/build.log
echo "[+${SECONDS}s] built"
(cd /tmp && timeout $((320 - SECONDS)) python -P $repo/benchmarks/bench_spec_draft.py $work/bf16 --method eagle3 \
  --draft $work/head --random-head --ks 1 3 --batch-sizes 1 --repeats 1 --tokens 64 --prompt-tokens 128 --profile \
  --json $OUT/eagle_8b_final.json > $OUT/bench.log 2>&1; grep -E "^B=|Error|Traceback" $OUT/bench.log | head)
echo "[+${SECONDS}s] done"
