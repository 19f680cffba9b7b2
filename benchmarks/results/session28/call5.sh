# session 28, call 5 (same machine as calls 2-4): FP8 W8A8 after 26e2e14 (the norm and SiLU · mul quantize their own
# output): issue 12's decode-step profile at batch 1, 64 and 256 (profile_step.py, as session 27's call 6), and the
# run at max_num_seqs 1024 kernel by kernel, the tree before (69c8916) and this one
source benchmarks/results/session27/artifacts.sh
bash benchmarks/package_dir.sh $repo/.baseline69 /tmp/before
artifacts fp8
(cd /tmp && timeout 200 python $repo/benchmarks/profile_step.py $work/fp8 --batch-sizes 1,64,256 --json $OUT/profile-fp8-async.json 2>&1 \
  | grep '^{' | python -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print('fp8', {k: r.get(k) for k in ('batch_size', 'wall_ms', 'kernel_ms', 'kernel_sum_ms', 'gpu_busy', 'host_not_hidden_ms')})")
for variant in before:/tmp/before now:/tmp/llmcpkg; do
  v=${variant%%:*}
  (cd /tmp && PYTHONPATH=${variant#*:} timeout 150 python $repo/benchmarks/profile_throughput.py "$work/fp8=fp8-$v-1024@max_num_seqs=1024" \
    --kernels --top 12 --json $OUT/tprofile-fp8-$v.json > $OUT/tprofile-fp8-$v.log 2>&1)
  grep -E "output tokens/s|decode:|mixed:|kernels:|^ +[0-9.]+ s" $OUT/tprofile-fp8-$v.log | cut -c1-150
done
