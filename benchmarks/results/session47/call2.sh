# session 47, call 2, on an H200: EAGLE's draft steps replayed from CUDA graphs (helper h21: runtime/eagle_graphs.py),
# their GPU tests and the 8B-shaped EAGLE-3 cost again (session 46: 10.81 ms per k = 3 step with eager draft steps,
# 4.54 ms per token without a head); then the memory plan's decode-graph allowance on the DeepSeek-V2-Lite shape with
# the graphs' block tables counted (call 1: capture overran it by 2.3 MiB)
source benchmarks/gpu_env.sh
export PYTHONPATH=$PYTHONPATH:$repo/benchmarks/results/session47
timeout 200 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/runtime/test_eagle_graphs.py \
  tests/runtime/test_spec_eagle.py -v > $OUT/pytest.log 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|^E " $OUT/pytest.log | head -30
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
(cd /tmp && timeout 200 python -P $repo/benchmarks/bench_spec_draft.py $work/bf16 --method eagle3 \
  --draft $work/head --random-head --ks 1 3 --batch-sizes 1 8 --repeats 2 --tokens 64 --prompt-tokens 128 \
  --json $OUT/eagle_8b_draft_graphs.json 2>&1 | grep -E "^B=|Error|error|Traceback|draft steps|WARN" | head -20)
echo "[+${SECONDS}s] bench done"
(timeout 60 python -P $repo/benchmarks/make_checkpoint.py --out /tmp/dsv2lite --arch deepseek-v2-lite > /dev/null 2>&1 && \
  timeout 120 python -P $repo/benchmarks/memory_check.py --model /tmp/dsv2lite --json $OUT/memory_check_dsv2lite.json 2>&1 \
  | grep -E "took|CUDA graphs|KV difference")
echo "[+${SECONDS}s] done"
