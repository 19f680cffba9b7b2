# session 47, call 4, on an H200: the expanded MLA form's query blocks on CUDA (call 3: V3's 2048-token prompt 1.78 ms
# against session 46's one SDPA call 1.40; its calls hold at most EXPAND_MAX_SCORES = 2^28 scores, 1024 queries there),
# the same run at 2^28 (the default), 2^31 and 2^40 (one call per chunk)
source benchmarks/gpu_env.sh
i=0; for e in 28 31 40 28; do i=$((i+1))
  timeout 100 python -P benchmarks/results/session47/scores_probe.py $e --out $OUT/scores_${i}_2e$e.json \
    --lengths 512,2048,8192,16384 --cached 4096,32768 --reps 5 > $OUT/scores_${i}_2e$e.log 2>&1 || tail -3 $OUT/scores_${i}_2e$e.log
  echo "[+${SECONDS}s] 2^$e"
done
