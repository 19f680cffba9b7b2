# session 54, call 2: a step of few long pieces on the narrow chunked tile (kernels/recurrent.CHUNKED_NARROW: the table's
# tile left SMs idle). The kernels' GPU tests; one layer's prefills (bench_hybrid.py) and the Qwen3.5-9B-shaped model's
# time to first token (prefill_host.py) on the code before (.before54 = git archive 323d51c of the packages) and now,
# alternating, twice
source benchmarks/gpu_env.sh
bash benchmarks/package_dir.sh $repo/.before54 /tmp/llmcpkg_before
mkdir -p /tmp/gpudeps && tar -xJf .gpu_deps.tar.xz -C /tmp/gpudeps
NOW=$PYTHONPATH
(PYTHONPATH=$NOW:/tmp/gpudeps:$repo/benchmarks/results/session50 timeout 150 python -P -m pytest -p no:cacheprovider \
  -p printfail -m gpu tests/kernels/test_recurrent.py -q > $OUT/pytest.log 2>&1)
grep -E "FAILED|passed|failed|Error" $OUT/pytest.log | head -20
echo "[+${SECONDS}s] tests done"
for round in 1 2; do
  for variant in before now; do
    if [ $variant = before ]; then P=/tmp/llmcpkg_before; else P=$NOW; fi
    PYTHONPATH=$P timeout 100 python -P benchmarks/bench_hybrid.py --layers deltanet mamba2 \
      --json $OUT/layer-$variant-$round.json 2>&1 | grep -E "^(deltanet|mamba2) +prefill"
    echo "[+${SECONDS}s] layer $variant round $round done"
  done
done
W=/tmp/q35; mkdir -p $W
(cd /tmp && python -P $repo/benchmarks/make_checkpoint.py --arch qwen3_5 --out $W/ckpt) > $OUT/make.log 2>&1
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
for round in 1 2; do
  for variant in before now; do
    if [ $variant = before ]; then P=/tmp/llmcpkg_before; else P=$NOW; fi
    (cd /tmp && PYTHONPATH=$P timeout 120 python -P $repo/benchmarks/prefill_host.py $W/bf16=$variant \
      --prompt-lens 2048 4096 --repeats 5 --profiled 1 --top 0 --json $OUT/ttft-$variant-$round.json) 2>&1 | grep "TTFT"
    echo "[+${SECONDS}s] ttft $variant round $round done"
  done
done
