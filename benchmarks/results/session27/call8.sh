# session 27, call 8 (issue 13: "W4A16 throughput at 128/128 >= the bf16 artifact's in the same run", last measured in
# session 15, 1.006-1.008x): the final tree, both artifacts at their build's max_num_seqs 256, two alternating rounds
repo=$PWD; work=/tmp/llmc-pairs; mkdir -p $work
source benchmarks/gpu_env.sh
[ -f $work/ckpt/config.json ] || python benchmarks/make_checkpoint.py --out $work/ckpt | tail -1
for q in bf16 w4a16; do
  [ -f $work/$q/manifest.json ] && continue
  quant='{method: none}'; [ $q = w4a16 ] && quant='{method: rtn, bits: 4, group_size: 128, symmetric: true}'
  printf 'model: %s/ckpt\noutput: %s/%s\ndtype: bfloat16\nquantization: %s\nruntime: {max_model_len: 4096, max_num_seqs: 256, max_num_batched_tokens: 8192}\ntarget: {device: cuda, gpu_memory_gib: 80}\n' \
    $work $work $q "$quant" > $work/$q.yaml
  (cd $work && python -m llmc.cli build $work/$q.yaml -q | tail -1) &
done
wait
(cd /tmp && python $repo/benchmarks/bench_e2e.py "$work/w4a16=w4a16-r1" "$work/bf16=bf16-r1" "$work/w4a16=w4a16-r2" "$work/bf16=bf16-r2" \
  --parts throughput --throughput 128x128:1000 --time-limit 60 --json $OUT/e2e-w4-vs-bf16.json 2>&1 | grep -E -- "->|Error|error:")
