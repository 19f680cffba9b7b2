# session 52, call 3: the Gated DeltaNet's gates and gated norm fused into the state kernels. The Qwen3.5-9B-shaped
# bf16 artifact's decode steps (profile_step.py at 1, 64, 256 sequences) on the code before (.before52 = git archive
# e5042fc of the packages) and now, alternating, twice; now with bf16 states once; then the GPU tests of the kernels
# and of the DeltaNet families
source benchmarks/gpu_env.sh
bash benchmarks/package_dir.sh $repo/.before52 /tmp/llmcpkg_before
mkdir -p /tmp/gpudeps && tar -xJf .gpu_deps.tar.xz -C /tmp/gpudeps
W=/tmp/q35; mkdir -p $W
(cd /tmp && python -P $repo/benchmarks/make_checkpoint.py --arch qwen3_5 --out $W/ckpt) > $OUT/make.log 2>&1
tail -1 $OUT/make.log; echo "[+${SECONDS}s] checkpoint done"
cat > $W/recipe.yaml <<R
model: $W/ckpt
output: $W/bf16
dtype: bfloat16
quantization: {method: none}
runtime: {max_model_len: 1024, max_num_seqs: 256, max_num_batched_tokens: 8192}
target: {device: cuda, gpu_memory_gib: 141}
R
(cd /tmp && python -P -m llmc.cli build $W/recipe.yaml -q) > $OUT/build.log 2>&1
tail -2 $OUT/build.log; rm -rf $W/ckpt; echo "[+${SECONDS}s] build done"
NOW=$PYTHONPATH
for round in 1 2; do
  for variant in before now; do
    if [ $variant = before ]; then P=/tmp/llmcpkg_before; else P=$NOW; fi
    PYTHONPATH=$P timeout 100 python -P benchmarks/profile_step.py $W/bf16 --batch-sizes 1,64,256 --steps 20 \
      --json $OUT/step-$variant-$round.json > $OUT/step-$variant-$round.log 2>&1
    grep '^{' $OUT/step-$variant-$round.log | python3 -c "import sys,json;[print(json.dumps({k:v for k,v in json.loads(l).items() if k in ('batch_size','wall_ms','kernel_ms','gpu_busy','host_not_hidden_ms')})) for l in sys.stdin]"
    echo "[+${SECONDS}s] $variant round $round done"
  done
done
timeout 100 python -P benchmarks/profile_step.py $W/bf16 --batch-sizes 1,64,256 --steps 20 --mamba-ssm-cache-dtype bfloat16 \
  --json $OUT/step-now-bf16.json > $OUT/step-now-bf16.log 2>&1
grep '^{' $OUT/step-now-bf16.log | cut -c1-330; echo "[+${SECONDS}s] now bf16 done"
rm -rf $W
export PYTHONPATH=$PYTHONPATH:/tmp/gpudeps:$repo/benchmarks/results/session50
timeout 200 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/kernels/test_recurrent.py \
  tests/runtime/test_qwen3_5.py tests/runtime/test_olmo_hybrid.py -v --durations=4 > $OUT/pytest.log 2>&1
grep -E "FAILED|ERROR|passed|failed|^E |s call" $OUT/pytest.log | head -30
echo "[+${SECONDS}s] tests done"
