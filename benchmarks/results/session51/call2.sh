# session 51, call 2: the state kernels' tiles and warps (bench_hybrid.py --sweep), then a Qwen3.5-9B-shaped bf16
# artifact's decode steps (profile_step.py at 1, 64, 256 sequences) on the Triton kernels and on the torch path
source benchmarks/gpu_env.sh
export PYTHONPATH=$PYTHONPATH:$repo/benchmarks/results/session50
timeout 150 python -P benchmarks/bench_hybrid.py --sweep --json $OUT/sweep.json > $OUT/sweep.log 2>&1
tail -3 $OUT/sweep.log; echo "[+${SECONDS}s] sweep done"
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
timeout 170 python -P benchmarks/profile_step.py $W/bf16 --batch-sizes 1,64,256 --steps 20 --json $OUT/step-triton.json > $OUT/step-triton.log 2>&1
grep '^{' $OUT/step-triton.log | cut -c1-400; echo "[+${SECONDS}s] triton steps done"
timeout 170 python -P benchmarks/profile_step.py $W/bf16 --batch-sizes 1,64,256 --steps 20 --torch-state-layers --json $OUT/step-torch.json > $OUT/step-torch.log 2>&1
grep '^{' $OUT/step-torch.log | cut -c1-400; tail -2 $OUT/step-torch.log; echo "[+${SECONDS}s] torch steps done"
