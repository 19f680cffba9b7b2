# session 26, call 5 (issue 12): the last 24 steps of call 4's run one by one (profile_throughput --tail): why the GPU
# waits ~11 ms before each decode step while the batch drains at max_num_seqs 1024
STAGE_LIMIT_S=575 TPROFILE_RUNS="bf16=bf16-1024@max_num_seqs=1024" TPROFILE_ARGS="--tail 24" \
  bash benchmarks/bench_8b.sh tprofile $OUT
