# session 41, call 1, on an H200: the GPU tests of sequence classifiers (and embeddings again), then classification
# throughput against transformers' AutoModelForSequenceClassification on an 8-layer classifier of Llama-3-8B's widths
# (bf16, 2 labels)
source benchmarks/gpu_env.sh
repo=$PWD; work=/tmp/s41; mkdir -p $work
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 300 python -P -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_classify.py tests/runtime/test_pooling.py 2>&1 | tail -8
echo "[+${SECONDS}s] tests done"
[ -d $work/cls ] || python benchmarks/make_checkpoint.py --out $work/cls --layers 8 --classifier 2 | tail -1
printf 'model: %s/cls\noutput: %s/cls_bf16\ndtype: bfloat16\nquantization: {method: none}\nruntime: {max_model_len: 1024, max_num_seqs: 256, max_num_batched_tokens: 8192}\ntarget: {device: cuda}\n' $work $work > $work/cls.yaml
[ -d $work/cls_bf16 ] || (cd $work && python -m llmc.cli build $work/cls.yaml -q | tail -1)
echo "[+${SECONDS}s] built"
(cd /tmp && timeout 240 python -P $repo/benchmarks/bench_embed.py $work/cls_bf16 --checkpoint $work/cls --task classify \
  --lengths 32 128 512 --num-prompts 256 --repeats 3 --option gpu_memory_utilization=0.3 --json $OUT/classify.json 2>&1 \
  | grep -E "^llmc L|^transformers L|^L=|Error|error")
echo "[+${SECONDS}s] done"
