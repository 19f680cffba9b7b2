# session 38, call 2, on an H200: issue 12's bf16 pair again (session 28 measured one H200 pair, 1.75x): this tree's
# bf16 throughput (128/128 x 1000, max_num_seqs 1024) and the engine before the overlap (73466ca, `git archive
# 73466ca | tar -x -C .baseline73`, checkpoints/ removed) at 1024, alternating, two rounds, one artifact
source benchmarks/results/session27/artifacts.sh
old=$repo/.baseline73
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
artifacts bf16
echo "[+${SECONDS}s] built"
for r in 1 2; do
  (cd /tmp && timeout 120 python $repo/benchmarks/bench_e2e.py "$work/bf16=bf16-now-1024@max_num_seqs=1024" \
    --parts throughput --throughput 128x128:1000 --time-limit 60 --json $OUT/e2e-bf16-now-r$r.json 2>&1 | grep -E -- "->|Error|error:")
  echo "[+${SECONDS}s] now r$r"
  timeout 150 bash $repo/benchmarks/baseline_e2e.sh $old $work/bf16 bf16-before-1024 $OUT/e2e-bf16-before-r$r.json \
    --parts throughput --throughput 128x128:1000 --time-limit 60 --max-num-seqs 1024 2>&1 | grep -E -- "->|Error|error:"
  echo "[+${SECONDS}s] before r$r"
done
