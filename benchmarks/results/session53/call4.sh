# session 53, call 4: time to first token of one request on the Qwen3.5-9B-shaped bf16 artifact (random weights,
# transformers' Qwen3_5TextConfig defaults) with prompts of 512, 2048 and 4096 tokens (prefill_host.py, one request at
# a time, 5 each), the code before this session (.before53 = git archive 8336b36 of the packages: the DeltaNet's token
# loop) and now (the chunked kernels), alternating, twice; then the GPU tests of the kernels and the hybrid families
source benchmarks/gpu_env.sh
bash benchmarks/package_dir.sh $repo/.before53 /tmp/llmcpkg_before
mkdir -p /tmp/gpudeps && tar -xJf .gpu_deps.tar.xz -C /tmp/gpudeps
W=/tmp/q35; mkdir -p $W
(cd /tmp && python -P $repo/benchmarks/make_checkpoint.py --arch qwen3_5 --out $W/ckpt) > $OUT/make.log 2>&1
tail -1 $OUT/make.log; echo "[+${SECONDS}s] checkpoint done"
cat > $W/recipe.yaml <<R
model: $W/ckpt
output: $W/bf16
dtype: bfloat16
quantization: {method: none}
runtime: {max_model_len: 4200, max_num_seqs: 16, max_num_batched_tokens: 8192}
target: {device: cuda, gpu_memory_gib: 141}
R
(cd /tmp && python -P -m llmc.cli build $W/recipe.yaml -q) > $OUT/build.log 2>&1
tail -2 $OUT/build.log; rm -rf $W/ckpt; echo "[+${SECONDS}s] build done"
NOW=$PYTHONPATH
for round in 1 2; do
  for variant in before now; do
    if [ $variant = before ]; then P=/tmp/llmcpkg_before; else P=$NOW; fi
    (cd /tmp && PYTHONPATH=$P timeout 150 python -P $repo/benchmarks/prefill_host.py $W/bf16=$variant \
      --prompt-lens 512 2048 4096 --repeats 5 --profiled 1 --top 0 --json $OUT/ttft-$variant-$round.json) \
      2>&1 | grep "TTFT"
    echo "[+${SECONDS}s] $variant round $round done"
  done
done
rm -rf $W
export PYTHONPATH=$PYTHONPATH:/tmp/gpudeps:$repo/benchmarks/results/session50
timeout 240 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/kernels/test_recurrent.py \
  tests/runtime/test_qwen3_5.py tests/runtime/test_granite4_hybrid.py tests/runtime/test_nemotron_h.py -q \
  --durations=3 > $OUT/pytest.log 2>&1
grep -E "FAILED|ERROR|passed|failed|^E |s call" $OUT/pytest.log | head -30
echo "[+${SECONDS}s] tests done"
