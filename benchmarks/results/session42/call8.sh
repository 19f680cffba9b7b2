# session 42, call 8, on an H200: where a 16-token prompt given as embeddings spends its time to first token (cProfile)
source benchmarks/gpu_env.sh
repo=$PWD; work=/tmp/s42; mkdir -p $work
[ -d $work/ck ] || python benchmarks/make_checkpoint.py --out $work/ck --layers 8 | tail -1
printf 'model: %s/ck\noutput: %s/bf16\ndtype: bfloat16\nquantization: {method: none}\nruntime: {max_model_len: 1024, max_num_seqs: 256, max_num_batched_tokens: 8192}\ntarget: {device: cuda}\n' $work $work > $work/r.yaml
[ -d $work/bf16 ] || (cd $work && python -m llmc.cli build $work/r.yaml -q | tail -1)
(cd /tmp && timeout 300 python -P $repo/benchmarks/bench_prompt_embeds.py $work/bf16 --device cuda --repeats 3 --ttft-len 16 \
  --num-prompts 8 --len 64 --max-tokens 4 --profile --option gpu_memory_utilization=0.5 2>&1 \
  | grep -vE "^\s*$|Ordered by|function calls" | cut -c1-160 | head -80)
