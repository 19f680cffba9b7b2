# session 28, call 6, on an H200 (issue 12's FP8 figure beside TensorRT-LLM's 27,911 tokens/s, which is an H200
# figure): this tree's FP8 W8A8 and bf16 throughput (128/128 x 1000) at max_num_seqs 1024 and 512, and the engine
# before the overlap (73466ca, `git archive 73466ca | tar -x -C .baseline73`, checkpoints/ removed) at 1024, same call
source benchmarks/results/session27/artifacts.sh
old=$repo/.baseline73
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
artifacts bf16 fp8
for q in fp8 bf16; do
  (cd /tmp && timeout 150 python $repo/benchmarks/bench_e2e.py "$work/$q=$q-now-1024@max_num_seqs=1024" "$work/$q=$q-now-512@max_num_seqs=512" \
    --parts throughput --throughput 128x128:1000 --time-limit 60 --json $OUT/e2e-$q-now.json 2>&1 | grep -E -- "->|Error|error:")
  bash $repo/benchmarks/baseline_e2e.sh $old $work/$q $q-before-1024 $OUT/e2e-$q-before-1024.json \
    --parts throughput --throughput 128x128:1000 --time-limit 60 --max-num-seqs 1024 2>&1 | grep -E -- "->|Error|error:"
done
