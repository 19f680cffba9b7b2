# session 52, call 2: a Qwen3.5-9B-shaped bf16 artifact's decode steps (profile_step.py at 1, 64, 256 sequences) with
# float32 recurrent states (auto) and with mamba_ssm_cache_dtype bfloat16, same run, twice each alternating
source benchmarks/gpu_env.sh
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
tail -3 $OUT/build.log; rm -rf $W/ckpt; echo "[+${SECONDS}s] build done"
for round in 1 2; do
  for dtype in auto bfloat16; do
    timeout 110 python -P benchmarks/profile_step.py $W/bf16 --batch-sizes 1,64,256 --steps 20 \
      --mamba-ssm-cache-dtype $dtype --json $OUT/step-$dtype-$round.json > $OUT/step-$dtype-$round.log 2>&1
    grep '^{' $OUT/step-$dtype-$round.log | cut -c1-300; grep -i "states (" $OUT/step-$dtype-$round.log | cut -c1-200
    echo "[+${SECONDS}s] $dtype round $round done"
  done
done
