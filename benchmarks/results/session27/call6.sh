# session 27, call 6 (issue 12's first item on the final tree): benchmarks/profile_step.py at batch 1, 64 and 256 on
# the bf16 and FP8 W8A8 8B-shaped artifacts (max_num_seqs 256), overlapped engine: wall per decode step, GPU kernel
# time, GPU busy, host time not hidden (bench_8b.sh overlap-* without its sync and bench_e2e parts)
repo=$PWD; work=/tmp/llmc-pairs; mkdir -p $work
source benchmarks/gpu_env.sh
[ -f $work/ckpt/config.json ] || python benchmarks/make_checkpoint.py --out $work/ckpt | tail -1
for q in bf16 fp8; do
  [ -f $work/$q/manifest.json ] && continue
  quant='{method: none}'; [ $q = fp8 ] && quant='{method: fp8}'
  printf 'model: %s/ckpt\noutput: %s/%s\ndtype: bfloat16\nquantization: %s\nruntime: {max_model_len: 4096, max_num_seqs: 256, max_num_batched_tokens: 8192}\ntarget: {device: cuda, gpu_memory_gib: 80}\n' \
    $work $work $q "$quant" > $work/$q.yaml
  (cd $work && python -m llmc.cli build $work/$q.yaml -q | tail -1) &
done
wait
for q in bf16 fp8; do
  (cd /tmp && timeout 200 python $repo/benchmarks/profile_step.py $work/$q --batch-sizes 1,64,256 --json $OUT/profile-$q-async.json 2>&1 \
    | grep '^{' | python -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print('$q', {k: r.get(k) for k in ('batch_size', 'wall_ms', 'kernel_ms', 'gpu_busy', 'host_not_hidden_ms')})")
done
