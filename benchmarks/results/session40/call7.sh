# session 40, call 7, on an H200: decode graphs captured with and without the LoRA kernels
# (compilation_config.cudagraph_specialize_lora): the GPU LoRA tests, then the cost measure (one adapter, batch 1
# and 64; mode "slots" now replays the graphs without LoRA), the artifact built again if the machine is fresh
source benchmarks/gpu_env.sh
repo=$PWD; work=/tmp/s40; mkdir -p $work
timeout 200 python -P -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_lora_runtime.py tests/runtime/test_cuda_graphs.py \
  tests/runtime/test_pooling.py 2>&1 | tail -4
echo "[+${SECONDS}s] tests done"
if [ ! -f $work/bf16/manifest.json ]; then
  python benchmarks/make_checkpoint.py --out $work/ckpt --layers 8 | tail -1
  printf 'model: %s/ckpt\noutput: %s/bf16\ndtype: bfloat16\nquantization: {method: none}\nruntime: {max_model_len: 1024, max_num_seqs: 256, max_num_batched_tokens: 8192}\ntarget: {device: cuda}\n' $work $work > $work/bf16.yaml
  (cd $work && python -m llmc.cli build $work/bf16.yaml -q | tail -1)
fi
echo "[+${SECONDS}s] built"
(cd /tmp && timeout $((580 - SECONDS)) python -P $repo/benchmarks/bench_lora.py $work/bf16 --adapters 1 --rank 16 \
  --batch-sizes 1 64 --tokens 64 --repeats 3 --option gpu_memory_utilization=0.25 --json $OUT/lora.json 2>&1 \
  | grep -E "^B=|Error|error|CUDA graphs")
echo "[+${SECONDS}s] done"
