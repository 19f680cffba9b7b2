# session 51, call 4: the Qwen3.5-9B-shaped bf16 artifact's decode steps (profile_step.py at 1, 64, 256 sequences) on
# the final code's kernels and on the torch path (call 2's pair, redone after the tiles changed), then Bamba's and
# Nemotron-H's GPU cases (call 3 ran out of time before them)
source benchmarks/gpu_env.sh
mkdir -p /tmp/gpudeps && tar -xJf .gpu_deps.tar.xz -C /tmp/gpudeps
export PYTHONPATH=$PYTHONPATH:/tmp/gpudeps:$repo/benchmarks/results/session50
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
rm -rf $W/ckpt; echo "[+${SECONDS}s] build done"
timeout 110 python -P benchmarks/profile_step.py $W/bf16 --batch-sizes 1,64,256 --steps 20 --json $OUT/step-triton.json > $OUT/step-triton.log 2>&1
grep '^{' $OUT/step-triton.log | cut -c1-300; echo "[+${SECONDS}s] triton steps done"
timeout 130 python -P benchmarks/profile_step.py $W/bf16 --batch-sizes 1,64,256 --steps 20 --torch-state-layers --json $OUT/step-torch.json > $OUT/step-torch.log 2>&1
grep '^{' $OUT/step-torch.log | cut -c1-300; echo "[+${SECONDS}s] torch steps done"
timeout 150 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/runtime/test_bamba.py \
  tests/runtime/test_nemotron_h.py -v --durations=4 > $OUT/pytest.log 2>&1
grep -E "FAILED|ERROR|PASSED|passed|failed|^E |s call" $OUT/pytest.log | head -20
echo "[+${SECONDS}s] tests done"
