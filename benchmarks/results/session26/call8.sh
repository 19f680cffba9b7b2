# session 26, call 8 (issue 12): call 7 gave 2.01x (this tree 17,100 against the old engine's 8,526 output tokens/s,
# both at max_num_seqs 1024) where session 10 gave 1.87x: three more alternating pairs in one call, one artifact
# (old tree as in call 7). Attempts: the first stopped after one run (its grep read stdout; the lines are on stderr);
# the second (records in call8/) ran this tree only in round 1: the baseline had edited the artifact's manifest,
# which this tree then refused; now the manifest is put back after each baseline run
repo=$PWD; old=$repo/.baseline73; work=/tmp/llmc-pairs; mkdir -p $work
source benchmarks/gpu_env.sh
python benchmarks/make_checkpoint.py --out $work/ckpt | tail -1
printf 'model: %s/ckpt\noutput: %s/bf16\ndtype: bfloat16\nquantization: {method: none}\nruntime: {max_model_len: 4096, max_num_seqs: 256, max_num_batched_tokens: 8192}\ntarget: {device: cuda, gpu_memory_gib: 80}\n' \
  $work $work > $work/bf16.yaml
(cd $work && python -m llmc.cli build $work/bf16.yaml -q | tail -1)
for round in 1 2 3; do
  (source $repo/benchmarks/gpu_env.sh; cd /tmp && python $repo/benchmarks/bench_e2e.py "$work/bf16=bf16-now-1024-r$round@max_num_seqs=1024" \
    --parts throughput --throughput 128x128:1000 --time-limit 60 --json $OUT/e2e-bf16-now-r$round.json 2>&1 | grep -E -- "->|Error|error:")
  cp $work/bf16/manifest.json $work/manifest.json.keep  # the baseline drops keys its reader does not know, in place
  bash $repo/benchmarks/baseline_e2e.sh $old $work/bf16 bf16-before-1024-r$round $OUT/e2e-bf16-before-r$round.json \
    --parts throughput --throughput 128x128:1000 --time-limit 60 --max-num-seqs 1024 2>&1 | grep -E -- "->|Error|error:"
  cp $work/manifest.json.keep $work/bf16/manifest.json
done
rm -rf $work
