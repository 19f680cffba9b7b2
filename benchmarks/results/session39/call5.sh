# session 39, call 5, on an H200: what run-time LoRA costs. An 8B-widths bf16 model cut to 8 layers (make_checkpoint
# --layers 8: the per-layer shapes of Llama-3.1-8B), 4 random rank-16 adapters on every projection; decode ms/step
# without LoRA, with the slots on but no adapter used, and with the requests spread over the 4 adapters (bench_lora.py)
source benchmarks/gpu_env.sh
repo=$PWD; work=/tmp/lora8; mkdir -p $work
nvidia-smi --query-gpu=name --format=csv,noheader
python benchmarks/make_checkpoint.py --out $work/ckpt --layers 8 | tail -1
printf 'model: %s/ckpt\noutput: %s/bf16\ndtype: bfloat16\nquantization: {method: none}\nruntime: {max_model_len: 1024, max_num_seqs: 64, max_num_batched_tokens: 8192}\ntarget: {device: cuda}\n' $work $work > $work/bf16.yaml
(cd $work && python -m llmc.cli build $work/bf16.yaml -q | tail -1)
echo "[+${SECONDS}s] built"
(cd /tmp && timeout $((570 - SECONDS)) python -P $repo/benchmarks/bench_lora.py $work/bf16 --adapters 4 --rank 16 \
  --batch-sizes 1 64 --tokens 64 --repeats 3 --option gpu_memory_utilization=0.25 --json $OUT/lora_8l.json 2>&1 \
  | grep -E "^B=|Error|error")
echo "[+${SECONDS}s] done"
