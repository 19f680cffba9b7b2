# session 27, call 5 (issue 12): FP8 W8A8 after this session's changes, same-run: this tree at max_num_seqs 512 and 1024,
# the engine before the overlap (73466ca) at 256 and 1024 (its best was one or the other, session 10)
repo=$PWD; old=$repo/.baseline73; work=/tmp/llmc-pairs; mkdir -p $work
source benchmarks/gpu_env.sh
[ -f $work/ckpt/config.json ] || python benchmarks/make_checkpoint.py --out $work/ckpt | tail -1
printf 'model: %s/ckpt\noutput: %s/fp8\ndtype: bfloat16\nquantization: {method: fp8}\nruntime: {max_model_len: 4096, max_num_seqs: 256, max_num_batched_tokens: 8192}\ntarget: {device: cuda, gpu_memory_gib: 80}\n' \
  $work $work > $work/fp8.yaml
(cd $work && python -m llmc.cli build $work/fp8.yaml -q | tail -1)
(source $repo/benchmarks/gpu_env.sh; cd /tmp && python $repo/benchmarks/bench_e2e.py "$work/fp8=fp8-now-512@max_num_seqs=512" \
  "$work/fp8=fp8-now-1024@max_num_seqs=1024" --parts throughput --throughput 128x128:1000 --time-limit 60 \
  --json $OUT/e2e-fp8-now.json 2>&1 | grep -E -- "->|Error|error:")
for seqs in 256 1024; do
  bash $repo/benchmarks/baseline_e2e.sh $old $work/fp8 fp8-before-$seqs $OUT/e2e-fp8-before-$seqs.json \
    --parts throughput --throughput 128x128:1000 --time-limit 60 --max-num-seqs $seqs 2>&1 | grep -E -- "->|Error|error:"
done
