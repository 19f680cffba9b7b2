#!/usr/bin/env bash
# Session 32: the W4A16 launch's TMA descriptors of the weights and the shared layouts built once
# (kernels/w4a16_gluon._weight_descriptor, _shared_layout). Its GPU tests, then host µs per call
# (launch_cost.py) and one short request's TTFT (prefill_host.py) with the tree before it (.base32 = git
# archive of 8b2e486's packages) and after, alternating, four rounds, in one call.
set -u
source benchmarks/gpu_env.sh
repo=$PWD
bash benchmarks/package_dir.sh .base32 /tmp/llmcpkg-before
work=/tmp/w32; mkdir -p $work/recipes
say() { echo "[$(date +%H:%M:%S) +${SECONDS}s] $*"; }
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
(cd /tmp && python $repo/benchmarks/make_checkpoint.py --out $work/ckpt > $OUT/ckpt.log 2>&1)
cat > $work/recipes/w4a16.yaml <<EOR
model: $work/ckpt
output: $work/w4a16
dtype: bfloat16
quantization: {method: rtn, bits: 4, group_size: 128, symmetric: true}
runtime: {max_model_len: 4096, max_num_seqs: 256, max_num_batched_tokens: 8192}
target: {device: cuda, gpu_memory_gib: 80}
EOR
(cd /tmp && python -m llmc.cli build $work/recipes/w4a16.yaml -q > $OUT/build-w4a16.log 2>&1) &
say "gpu tests (build running)"
timeout 300 python -P -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_w4a16.py tests/kernels/test_fused_ops.py -x 2>&1 | tail -15 > $OUT/gpu_tests.log
tail -3 $OUT/gpu_tests.log
wait
say "build done"; tail -2 $OUT/build-w4a16.log
for round in 1 2 3 4; do
  for tree in before now; do
    pp=/tmp/llmcpkg; [ $tree = before ] && pp=/tmp/llmcpkg-before
    (cd /tmp && PYTHONPATH=$pp python $repo/benchmarks/launch_cost.py --ms 1 16 128 --calls 300 --json $OUT/launch-$tree-$round.json 2>&1 | grep -v Warn > $OUT/launch-$tree-$round.log)
    say "launch_cost $tree $round"; grep -i w4a16 $OUT/launch-$tree-$round.log | tr '\n' ';' | cut -c1-400; echo
  done
done
for round in 1 2; do
  for tree in before now; do
    pp=/tmp/llmcpkg; [ $tree = before ] && pp=/tmp/llmcpkg-before
    (cd /tmp && PYTHONPATH=$pp timeout 120 python $repo/benchmarks/prefill_host.py $work/w4a16=w4a16-$tree \
       --prompt-lens 16 128 --repeats 15 --profiled 1 --top 5 --json $OUT/prefill-$tree-$round.json 2>&1 | grep "TTFT")
    say "prefill_host $tree $round"
  done
done
