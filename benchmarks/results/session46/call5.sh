# session 46, call 5, on an H200: gpt-oss on CUDA (helper h16: attention sinks in the Triton attention kernels, the
# fused MoE with expert biases and the clamped SwiGLU, the model against transformers with and without graphs); the
# speculative verify steps' whole-forward graphs (EAGLE's and the draft model's GPU tests); then call 2's 8B EAGLE-3
# cost at k = 3 again with them
source benchmarks/gpu_env.sh
export PYTHONPATH=$PYTHONPATH:$repo/benchmarks/results/session46
timeout 190 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/runtime/test_gpt_oss.py \
  tests/kernels/test_attention.py tests/kernels/test_fused_moe.py tests/runtime/test_spec_eagle.py \
  tests/runtime/test_spec_draft.py -k "sink or gpt_oss or biases or on_cuda" -v > $OUT/pytest.log 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|^E " $OUT/pytest.log | head -50
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
(cd /tmp && timeout $((480 - SECONDS)) python -P $repo/benchmarks/bench_spec_draft.py $work/bf16 --method eagle3 \
  --draft $work/head --random-head --ks 3 --batch-sizes 1 --repeats 2 --tokens 64 --prompt-tokens 128 \
  --json $OUT/eagle_8b_verify_graphs.json 2>&1 | grep -E "^B=|Error|error|Traceback|verify|whole" | head -20)
echo "[+${SECONDS}s] done"
