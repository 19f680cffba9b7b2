# session 54, call 3: FP8 W8A8 builds of the hybrid models (session 54) on CUDA. The GPU tests (Qwen3.5's FP8 builds,
# per channel and in 128-blocks, against transformers; the other hybrid families' GPU cases); then a Qwen3.5-9B-shaped
# checkpoint (random weights) built bf16 and fp8 (per channel, dynamic): decode steps (profile_step.py at 1, 64, 256
# sequences) and the time to first token of a 2048-token prompt (prefill_host.py), alternating, twice
source benchmarks/gpu_env.sh
mkdir -p /tmp/gpudeps && tar -xJf .gpu_deps.tar.xz -C /tmp/gpudeps
(PYTHONPATH=$PYTHONPATH:/tmp/gpudeps:$repo/benchmarks/results/session50 timeout 200 python -P -m pytest \
  -p no:cacheprovider -p printfail -m gpu tests/runtime/test_qwen3_5.py tests/runtime/test_granite4_hybrid.py -q \
  > $OUT/pytest.log 2>&1)
grep -E "FAILED|passed|failed|^E " $OUT/pytest.log | head -20
echo "[+${SECONDS}s] tests done"
W=/tmp/q35; mkdir -p $W
(cd /tmp && python -P $repo/benchmarks/make_checkpoint.py --arch qwen3_5 --out $W/ckpt) > $OUT/make.log 2>&1
for kind in bf16 fp8; do
  method=none; [ $kind = fp8 ] && method=fp8
  cat > $W/$kind.yaml <<R
model: $W/ckpt
output: $W/$kind
dtype: bfloat16
quantization: {method: $method}
runtime: {max_model_len: 4200, max_num_seqs: 256, max_num_batched_tokens: 8192}
target: {device: cuda, gpu_memory_gib: 141}
R
  (cd /tmp && python -P -m llmc.cli build $W/$kind.yaml -q) > $OUT/build-$kind.log 2>&1
  tail -2 $OUT/build-$kind.log; echo "[+${SECONDS}s] build $kind done"
done
rm -rf $W/ckpt
for round in 1 2; do
  for kind in bf16 fp8; do
    timeout 100 python -P benchmarks/profile_step.py $W/$kind --batch-sizes 1,64,256 --steps 20 \
      --json $OUT/step-$kind-$round.json > $OUT/step-$kind-$round.log 2>&1
    grep '^{' $OUT/step-$kind-$round.log | python3 -c "import sys,json;[print('$kind', json.dumps({k:v for k,v in json.loads(l).items() if k in ('batch_size','wall_ms','kernel_ms','gpu_busy')})) for l in sys.stdin]"
    echo "[+${SECONDS}s] steps $kind round $round done"
  done
done
for kind in bf16 fp8; do
  (cd /tmp && timeout 90 python -P $repo/benchmarks/prefill_host.py $W/$kind=$kind --prompt-lens 2048 --repeats 5 \
    --profiled 1 --top 0) 2>&1 | grep "TTFT"
done
echo "[+${SECONDS}s] ttft done"
