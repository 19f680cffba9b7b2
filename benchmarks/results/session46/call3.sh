# session 46, call 3, on an H200 (call 2's machine, its 8B artifact and random head reused when still there): where an
# EAGLE verify step's time goes (bench_spec_draft.py --profile: GPU busy time under torch.profiler, host functions
# under cProfile), with the piecewise graphs (default) and with cudagraph_mode FULL (whole-forward graphs of the
# verify steps, attention included)
source benchmarks/gpu_env.sh
work=/tmp/e8b
if [ ! -d $work/bf16 ]; then bash benchmarks/results/session46/call2.sh > /dev/null 2>&1; fi
ls $work
for mode in FULL_AND_PIECEWISE FULL; do
  (cd /tmp && timeout 240 python -P $repo/benchmarks/bench_spec_draft.py $work/bf16 --method eagle3 --draft $work/head \
    --ks 3 --batch-sizes 1 --repeats 2 --tokens 64 --prompt-tokens 128 --profile \
    --option "compilation_config={\"cudagraph_mode\": \"$mode\"}" \
    --json $OUT/eagle_8b_profile_$mode.json 2>&1 | grep -E "^B=|Error|error|Traceback" | head -20)
  echo "[+${SECONDS}s] $mode done"
done
