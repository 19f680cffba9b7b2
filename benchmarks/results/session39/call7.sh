# session 39, call 7, on an H200: call 6's LoRA cost measure with the prefix cache off in bench_lora.py (call 6's B=64
# rows were below the weights' read time: the 64-token run found the 32-token run's prompts cached)
source benchmarks/gpu_env.sh
repo=$PWD; work=/tmp/lora8; mkdir -p $work
python benchmarks/make_checkpoint.py --out $work/ckpt --layers 8 | tail -1
printf 'model: %s/ckpt\noutput: %s/bf16\ndtype: bfloat16\nquantization: {method: none}\nruntime: {max_model_len: 1024, max_num_seqs: 64, max_num_batched_tokens: 8192}\ntarget: {device: cuda}\n' $work $work > $work/bf16.yaml
(cd $work && python -m llmc.cli build $work/bf16.yaml -q | tail -1)
(cd /tmp && timeout 150 python -P $repo/benchmarks/bench_lora.py $work/bf16 --adapters 4 --rank 16 \
  --batch-sizes 1 64 --tokens 64 --repeats 3 --option gpu_memory_utilization=0.25 --json $OUT/lora_8l_c.json 2>&1 \
  | grep -E "^B=|Error|error")
echo "[+${SECONDS}s] done"
