# session 27, call 6 (issue 12's first item on the final tree): benchmarks/profile_step.py at batch 1, 64 and 256 on
# the bf16 and FP8 W8A8 8B-shaped artifacts (max_num_seqs 256), overlapped engine: wall per decode step, GPU kernel
# time, GPU busy, host time not hidden (bench_8b.sh overlap-* without its sync and bench_e2e parts)
source benchmarks/results/session27/artifacts.sh
artifacts bf16 fp8
for q in bf16 fp8; do
  (cd /tmp && timeout 200 python $repo/benchmarks/profile_step.py $work/$q --batch-sizes 1,64,256 --json $OUT/profile-$q-async.json 2>&1 \
    | grep '^{' | python -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print('$q', {k: r.get(k) for k in ('batch_size', 'wall_ms', ${KEYS:-'kernel_ms', 'gpu_busy'}, 'host_not_hidden_ms')})")
done
