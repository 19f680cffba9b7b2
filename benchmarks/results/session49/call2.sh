# session 49, call 2, on an H200: issue 12's measures again after sessions 39-48's features. (1) the bf16 pair of
# session 38 (benchmarks/results/session38/call2.sh): this tree's throughput 128/128 x 1000 at max_num_seqs 1024
# against the engine before the overlap (73466ca, `git archive 73466ca | tar -x -C .baseline73`, checkpoints/
# removed), alternating, two rounds, one artifact; (2) the CPU ratio (benchmarks/cpu_step_ratio.sh, 2 pinned cores
# of this machine's otherwise idle CPU)
bash benchmarks/cpu_step_ratio.sh $OUT/cpu 2 > $OUT/cpu.log 2>&1; echo "[+${SECONDS}s] cpu ratio rc $?"
python - <<'PY'
import json, os
for mode in ("async", "sync"):
    d = json.load(open(f"{os.environ['OUT']}/cpu/cpu-step-{mode}.json"))
    print(mode, json.dumps(d)[:600])
PY
bash benchmarks/results/session38/call2.sh
