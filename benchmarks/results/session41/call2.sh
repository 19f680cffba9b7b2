# session 41, call 2, on an H200: embedding throughput against transformers again (embeddings now keep their float32
# tensor; the list of floats is made when read), with one profiled call of each per length: where the time goes
source benchmarks/gpu_env.sh
repo=$PWD; work=/tmp/s41; mkdir -p $work
[ -d $work/ckpt ] || python benchmarks/make_checkpoint.py --out $work/ckpt --layers 8 | tail -1
printf 'model: %s/ckpt\noutput: %s/bf16\ndtype: bfloat16\nquantization: {method: none}\nruntime: {max_model_len: 1024, max_num_seqs: 256, max_num_batched_tokens: 8192}\ntarget: {device: cuda}\n' $work $work > $work/bf16.yaml
[ -d $work/bf16 ] || (cd $work && python -m llmc.cli build $work/bf16.yaml -q | tail -1)
echo "[+${SECONDS}s] built"
(cd /tmp && timeout 300 python -P $repo/benchmarks/bench_embed.py $work/bf16 --checkpoint $work/ckpt --lengths 32 128 512 \
  --num-prompts 256 --repeats 3 --profile --option gpu_memory_utilization=0.3 --json $OUT/embed.json 2>&1 \
  | grep -E "^llmc L|^transformers L|^L=|^profile|^  |Error|error")
echo "[+${SECONDS}s] done"
