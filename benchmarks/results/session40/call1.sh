# session 40, call 1, on an H200: the GPU tests of the new code (embeddings, LoRA's Triton kernels, run-time LoRA
# with the alternating slot-map buffers), then embedding throughput against transformers on an 8-layer model of
# Llama-3-8B's widths (bf16)
source benchmarks/gpu_env.sh
repo=$PWD; work=/tmp/s40; mkdir -p $work
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 300 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_lora_triton.py tests/runtime/test_lora_runtime.py \
  tests/runtime/test_pooling.py 2>&1 | tail -15
echo "[+${SECONDS}s] tests done"
python benchmarks/make_checkpoint.py --out $work/ckpt --layers 8 | tail -1
printf 'model: %s/ckpt\noutput: %s/bf16\ndtype: bfloat16\nquantization: {method: none}\nruntime: {max_model_len: 1024, max_num_seqs: 256, max_num_batched_tokens: 8192}\ntarget: {device: cuda}\n' $work $work > $work/bf16.yaml
(cd $work && python -m llmc.cli build $work/bf16.yaml -q | tail -1)
echo "[+${SECONDS}s] built"
(cd /tmp && timeout 200 python -P $repo/benchmarks/bench_embed.py $work/bf16 --checkpoint $work/ckpt --lengths 32 128 512 \
  --num-prompts 256 --repeats 3 --option gpu_memory_utilization=0.3 --json $OUT/embed.json 2>&1 | grep -E "^llmc L|^transformers L|^L=|Error|error")
echo "[+${SECONDS}s] done"
