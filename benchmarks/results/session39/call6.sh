# session 39, call 6, on an H200: call 5's LoRA cost measure again (its B=64 rows are wrong: the longer run found the shorter one's prompts in the prefix cache; call 7 reruns with the cache off) after the three-kernel sum (bench_lora.py now times
# decode steps as the difference of a 64- and a 32-token run), then the LoRA and draft-model GPU tests on the final code
source benchmarks/gpu_env.sh
repo=$PWD; work=/tmp/lora8; mkdir -p $work
nvidia-smi --query-gpu=name --format=csv,noheader
python benchmarks/make_checkpoint.py --out $work/ckpt --layers 8 | tail -1
printf 'model: %s/ckpt\noutput: %s/bf16\ndtype: bfloat16\nquantization: {method: none}\nruntime: {max_model_len: 1024, max_num_seqs: 64, max_num_batched_tokens: 8192}\ntarget: {device: cuda}\n' $work $work > $work/bf16.yaml
(cd $work && python -m llmc.cli build $work/bf16.yaml -q | tail -1)
echo "[+${SECONDS}s] built"
(cd /tmp && timeout 200 python -P $repo/benchmarks/bench_lora.py $work/bf16 --adapters 4 --rank 16 \
  --batch-sizes 1 64 --tokens 64 --repeats 3 --option gpu_memory_utilization=0.25 --json $OUT/lora_8l_b.json 2>&1 \
  | grep -E "^B=|Error|error")
echo "[+${SECONDS}s] bench done"
timeout $((560 - SECONDS)) python -P -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_lora_runtime.py \
  tests/runtime/test_spec_draft.py 2>&1 | tail -3
echo "[+${SECONDS}s] done"
