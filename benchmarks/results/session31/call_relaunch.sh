#!/usr/bin/env bash
# Session 31: kernels/launch_triton.relaunch (the compiled kernel reused per argument class) on the GPU:
# its GPU tests, then host µs per call (launch_cost.py) and one short request's TTFT (prefill_host.py) with
# the tree before it (.base31 = git archive of 64ec2c3's packages) and after, alternating, in one call.
set -u
source benchmarks/gpu_env.sh
repo=$PWD
bash benchmarks/package_dir.sh .base31 /tmp/llmcpkg-before
work=/tmp/w31; mkdir -p $work/recipes
say() { echo "[$(date +%H:%M:%S) +${SECONDS}s] $*"; }
say "checkpoint"
(cd /tmp && python $repo/benchmarks/make_checkpoint.py --out $work/ckpt > $OUT/ckpt.log 2>&1)
for q in w4a16 fp8; do
  if [ $q = w4a16 ]; then yaml='{method: rtn, bits: 4, group_size: 128, symmetric: true}'; else yaml='{method: fp8}'; fi
  cat > $work/recipes/$q.yaml <<EOR
model: $work/ckpt
output: $work/$q
dtype: bfloat16
quantization: $yaml
runtime: {max_model_len: 4096, max_num_seqs: 256, max_num_batched_tokens: 8192}
target: {device: cuda, gpu_memory_gib: 141}
EOR
  (cd /tmp && python -m llmc.cli build $work/recipes/$q.yaml -q > $OUT/build-$q.log 2>&1) &
done
say "gpu tests (builds running)"
timeout 200 python -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_launch.py tests/kernels/test_fused_ops.py \
  tests/kernels/test_attention.py tests/kernels/test_sampling.py tests/kernels/test_w4a16.py -x 2>&1 | tail -15 > $OUT/gpu_tests.log
tail -3 $OUT/gpu_tests.log
wait
say "builds done"; tail -2 $OUT/build-*.log
for round in 1 2; do
  for tree in before now; do
    pp=/tmp/llmcpkg; [ $tree = before ] && pp=/tmp/llmcpkg-before
    (cd /tmp && PYTHONPATH=$pp python $repo/benchmarks/launch_cost.py --ms 16 128 --calls 200 --json $OUT/launch-$tree-$round.json 2>&1 | grep -v Warn > $OUT/launch-$tree-$round.log)
    say "launch_cost $tree $round"; grep -v part $OUT/launch-$tree-$round.log | tr '\n' ';' | cut -c1-600; echo
  done
done
for tree in before now before now; do
  pp=/tmp/llmcpkg; [ $tree = before ] && pp=/tmp/llmcpkg-before
  (cd /tmp && PYTHONPATH=$pp timeout 150 python $repo/benchmarks/prefill_host.py $work/w4a16=w4a16-$tree $work/fp8=fp8-$tree \
     --prompt-lens 16 128 --repeats 10 --profiled 1 --top 5 --json $OUT/prefill-$tree-$SECONDS.json 2>&1 | grep "TTFT")
  say "prefill_host $tree"
done
