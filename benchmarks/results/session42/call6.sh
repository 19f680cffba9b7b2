# session 42, call 6, on an H200: prompts given as embeddings against the same prompts as token ids (bench_prompt_embeds.py)
# on an 8-layer model of Llama-3.1-8B's widths, bf16: TTFT of one request and throughput of 64 x (512 + 64)
# (call 6: the code before the finiteness check moved to the device; call 7: after)
source benchmarks/gpu_env.sh
repo=$PWD; work=/tmp/s42; mkdir -p $work
[ -d $work/ck ] || python benchmarks/make_checkpoint.py --out $work/ck --layers 8 | tail -1
printf 'model: %s/ck\noutput: %s/bf16\ndtype: bfloat16\nquantization: {method: none}\nruntime: {max_model_len: 1024, max_num_seqs: 256, max_num_batched_tokens: 8192}\ntarget: {device: cuda}\n' $work $work > $work/r.yaml
[ -d $work/bf16 ] || (cd $work && python -m llmc.cli build $work/r.yaml -q | tail -1)
echo "[+${SECONDS}s] built"
(cd /tmp && timeout 300 python -P $repo/benchmarks/bench_prompt_embeds.py $work/bf16 --device cuda --repeats 5 \
  --option gpu_memory_utilization=0.5 --json $OUT/prompt_embeds.json 2>&1 | grep -E "^TTFT|^throughput|Error|error")
echo "[+${SECONDS}s] done"
