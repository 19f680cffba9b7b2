# session 27, call 2 (issue 12): two more same-run pairs, this tree and the engine before the overlap (73466ca), bf16
# at max_num_seqs 1024, alternating on one artifact (call 1's, rebuilt if the machine is a fresh one).
# As first run, round 3's "now" failed at once (ImportError: RequestOutputKind from /tmp/llmcpkg): baseline_e2e.sh
# sources the old tree's gpu_env.sh, which points /tmp/llmcpkg at the old tree, and this loop did not point it back
# (session 26's call 8 did). Its round 2 ran this tree (the call's first line points the link here). Call 3 reruns
# round 3 with the fix below and adds round 4.
repo=$PWD; old=$repo/.baseline73; work=/tmp/llmc-pairs; mkdir -p $work
source benchmarks/gpu_env.sh
if [ ! -f $work/bf16/manifest.json ]; then
  python benchmarks/make_checkpoint.py --out $work/ckpt | tail -1
  printf 'model: %s/ckpt\noutput: %s/bf16\ndtype: bfloat16\nquantization: {method: none}\nruntime: {max_model_len: 4096, max_num_seqs: 256, max_num_batched_tokens: 8192}\ntarget: {device: cuda, gpu_memory_gib: 80}\n' \
    $work $work > $work/bf16.yaml
  (cd $work && python -m llmc.cli build $work/bf16.yaml -q | tail -1)
fi
for round in ${ROUNDS:-2 3}; do
  (source $repo/benchmarks/gpu_env.sh; cd /tmp && python $repo/benchmarks/bench_e2e.py "$work/bf16=bf16-now-1024-r$round@max_num_seqs=1024" \
    --parts throughput --throughput 128x128:1000 --time-limit 60 --json $OUT/e2e-bf16-now-r$round.json 2>&1 | grep -E -- "->|Error|error:")
  bash $repo/benchmarks/baseline_e2e.sh $old $work/bf16 bf16-before-1024-r$round $OUT/e2e-bf16-before-r$round.json \
    --parts throughput --throughput 128x128:1000 --time-limit 60 --max-num-seqs 1024 2>&1 | grep -E -- "->|Error|error:"
done
