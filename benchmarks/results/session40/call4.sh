# session 40, call 4, on an H200: call 3's cost measure, which found no artifact (call 3 got a fresh machine):
# call 1's 8-layer bf16 artifact of Llama-3-8B's widths built again, then the reworked LoRA kernels against the
# torch path in the same process
source benchmarks/gpu_env.sh
repo=$PWD; work=/tmp/s40; mkdir -p $work
if [ ! -f $work/bf16/manifest.json ]; then
  python benchmarks/make_checkpoint.py --out $work/ckpt --layers 8 | tail -1
  printf 'model: %s/ckpt\noutput: %s/bf16\ndtype: bfloat16\nquantization: {method: none}\nruntime: {max_model_len: 1024, max_num_seqs: 256, max_num_batched_tokens: 8192}\ntarget: {device: cuda}\n' $work $work > $work/bf16.yaml
  (cd $work && python -m llmc.cli build $work/bf16.yaml -q | tail -1)
fi
echo "[+${SECONDS}s] built"
(cd /tmp && timeout $((580 - SECONDS)) python -P $repo/benchmarks/bench_lora.py $work/bf16 --adapters 4 --rank 16 --compare-torch \
  --batch-sizes 1 64 --tokens 64 --repeats 3 --option gpu_memory_utilization=0.25 --json $OUT/lora.json 2>&1 \
  | grep -E "^B=|Error|error")
echo "[+${SECONDS}s] done"
