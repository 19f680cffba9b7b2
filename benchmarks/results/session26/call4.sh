# session 26, call 4 (issue 12): where a bf16 throughput run's time goes at max_num_seqs 1024, the engine's best
# batch size (session 10: 17,266 output tokens/s against the old engine's 9,232); step by step and kernel by kernel
STAGE_LIMIT_S=575 TPROFILE_RUNS="bf16=bf16-1024@max_num_seqs=1024" TPROFILE_ARGS="--kernels --top 30" \
  bash benchmarks/bench_8b.sh tprofile $OUT
