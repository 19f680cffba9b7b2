# session 27, call 4 (issues 12 and 13): batch-1 decode after b6f9c3d (the step's logits stay bf16): the W4A16
# artifact (RTN g128 symmetric, bench_8b.sh's W4) beside gpt-fast int4 in the same call, and the bf16 artifact (issue
# 12's "no worse than 6.9 ms/token"); on call 1's checkpoint and bf16 artifact (made again on a fresh machine)
source benchmarks/results/session27/artifacts.sh
artifacts bf16 w4a16
timeout 200 python benchmarks/gptfast_int4.py $work/ckpt --json $OUT/gptfast-int4.json 2>&1 | tail -3
(cd /tmp && timeout 240 python $repo/benchmarks/bench_e2e.py "$work/w4a16=w4a16" "$work/bf16=bf16" --parts decode \
  --json $OUT/e2e-decode.json --budget 220 2>&1 | grep -v "^\[" | tail -25)
