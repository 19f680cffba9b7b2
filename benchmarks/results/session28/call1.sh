# session 28, call 1 (issue 12): FP8 W8A8 at max_num_seqs 1024 and 512, step by step and kernel by kernel -- is the
# host the limit of the FP8 run (session 27: 0.75 ms not hidden per 256-row step)? And the bf16 run at 1024 with the
# SM clock and power logged every 100 ms (session 27 guessed the decode GEMMs run slower than bench_kernels' because
# the clocks drop under sustained load; not verified)
source benchmarks/results/session27/artifacts.sh
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
artifacts bf16 fp8
(cd /tmp && timeout 240 python $repo/benchmarks/profile_throughput.py "$work/fp8=fp8-1024@max_num_seqs=1024" \
  "$work/fp8=fp8-512@max_num_seqs=512" --kernels --top 20 --json $OUT/tprofile-fp8.json > $OUT/tprofile-fp8.log 2>&1)
tail -80 $OUT/tprofile-fp8.log | cut -c1-180
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 100 > $OUT/clocks-bf16.csv & smi=$!
(cd /tmp && timeout 200 python $repo/benchmarks/profile_throughput.py "$work/bf16=bf16-1024@max_num_seqs=1024" \
  --json $OUT/tprofile-bf16.json > $OUT/tprofile-bf16.log 2>&1)
kill $smi; tail -30 $OUT/tprofile-bf16.log | cut -c1-180
python - $OUT/clocks-bf16.csv <<'PY'
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))[1:]
mhz = [int(r[1].split()[0]) for r in rows if r[1].strip().split()[0].isdigit()]
watts = [float(r[3].split()[0]) for r in rows if r[3].strip().split()[0].replace('.', '').isdigit()]
busy = [(m, w) for m, w in zip(mhz, watts) if w > 300]
print("samples", len(rows), "under load (>300 W):", len(busy))
if busy:
    print("SM MHz under load: min %d median %d max %d" % (min(m for m, _ in busy), sorted(m for m, _ in busy)[len(busy)//2], max(m for m, _ in busy)))
    print("power under load: median %.0f max %.0f" % (sorted(w for _, w in busy)[len(busy)//2], max(w for _, w in busy)))
print(collections.Counter(r[5].strip() for r in rows).most_common(5))
PY
