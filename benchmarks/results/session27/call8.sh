# session 27, call 8 (issue 13: "W4A16 throughput at 128/128 >= the bf16 artifact's in the same run", last measured in
# session 15, 1.006-1.008x): the final tree, both artifacts at their build's max_num_seqs 256, two alternating rounds
source benchmarks/results/session27/artifacts.sh
artifacts bf16 w4a16
(cd /tmp && python $repo/benchmarks/bench_e2e.py "$work/w4a16=w4a16-r1" "$work/bf16=bf16-r1" "$work/w4a16=w4a16-r2" "$work/bf16=bf16-r2" \
  --parts throughput --throughput 128x128:1000 --time-limit 60 --json $OUT/e2e-w4-vs-bf16.json 2>&1 | grep -E -- "->|Error|error:")
