# session 46, call 2, on an H200: what an EAGLE-3 head costs on an 8B-shaped bf16 model (random weights and a random
# head of its shapes: no draft is accepted, so each verify step emits one token and its time is the mechanism's
# cost), against the same engine without speculation in the same process; the EAGLE GPU test after fill's change
# (drafts kept on the device between head steps)
source benchmarks/gpu_env.sh
export PYTHONPATH=$PYTHONPATH:$repo/benchmarks/results/session46
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 100 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/runtime/test_spec_eagle.py -v > $OUT/pytest.log 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|^E " $OUT/pytest.log | head -20
echo "[+${SECONDS}s] tests done"
work=/tmp/e8b; mkdir -p $work
(cd /tmp && timeout 150 python $repo/benchmarks/make_checkpoint.py --out $work/ckpt > $OUT/ckpt.log 2>&1) || tail -5 $OUT/ckpt.log
cat > $work/bf16.yaml <<YAML
model: $work/ckpt
output: $work/bf16
dtype: bfloat16
quantization: {method: none}
runtime: {max_model_len: 4096, max_num_seqs: 64, max_num_batched_tokens: 8192}
target: {device: cuda, gpu_memory_gib: 141}
YAML
(cd /tmp && timeout 150 python -m llmc.cli build $work/bf16.yaml -q > $OUT/build.log 2>&1) || tail -5 $OUT/build.log
echo "[+${SECONDS}s] built"
(cd /tmp && timeout $((590 - SECONDS)) python -P $repo/benchmarks/bench_spec_draft.py $work/bf16 --method eagle3 \
  --draft $work/head --random-head --ks 1 3 --batch-sizes 1 8 --repeats 2 --tokens 64 --prompt-tokens 128 \
  --json $OUT/eagle_8b_bf16.json 2>&1 | grep -E "^B=|Error|error|Traceback" | head -20)
echo "[+${SECONDS}s] done"
