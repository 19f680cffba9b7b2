#!/usr/bin/env bash
# Session 32, call 2 (same warm H100 as call1.sh, whose GPU tests passed and whose timing part ran out of
# time): launch_cost.py before / now alternating, three rounds, then prefill_host.py on the W4A16 artifact
# call 1 built (if it finished). Everything into one log (call 1's many files were not all returned).
set -u
source benchmarks/gpu_env.sh
repo=$PWD
bash benchmarks/package_dir.sh .base32 /tmp/llmcpkg-before
work=/tmp/w32
say() { echo "[$(date +%H:%M:%S) +${SECONDS}s] $*"; }
log=$OUT/call2.log
ls $work/w4a16/manifest.json >> $log 2>&1 || { say "artifact missing: building"; (cd /tmp && python -m llmc.cli build $work/recipes/w4a16.yaml -q >> $log 2>&1); }
say "artifact ready"
for round in 1 2 3; do
  for tree in now before; do
    pp=/tmp/llmcpkg; [ $tree = before ] && pp=/tmp/llmcpkg-before
    echo "== launch_cost $tree round $round" >> $log
    (cd /tmp && PYTHONPATH=$pp python $repo/benchmarks/launch_cost.py --ms 16 128 --calls 300 2>&1 | grep -v -i warn >> $log)
    say "launch_cost $tree $round"
  done
done
for round in 1 2; do
  for tree in now before; do
    pp=/tmp/llmcpkg; [ $tree = before ] && pp=/tmp/llmcpkg-before
    echo "== prefill_host $tree round $round" >> $log
    (cd /tmp && PYTHONPATH=$pp timeout 100 python $repo/benchmarks/prefill_host.py $work/w4a16=w4a16-$tree \
       --prompt-lens 16 128 --repeats 15 --profiled 1 --top 3 2>&1 | grep "TTFT" >> $log)
    say "prefill_host $tree $round"
  done
done
grep -E "==|w4a16|TTFT" $log
