# session 26, call 1: the warp-specialized candidates (TMA-store epilogue since session 25) against the table's
# picks at 128-4096 tokens, two rounds in one process each, for a re-recorded table
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
cd /tmp
for r in a b; do
  timeout 285 python $OLDPWD/benchmarks/w4a16_kind_sweep.py --kind wgmma_ws --ms 128 256 512 1024 4096 \
    --json $OUT/ws_sweep_$r.json > $OUT/ws_sweep_$r.log 2>&1; echo "round $r rc=$?"; grep " M=" $OUT/ws_sweep_$r.log
done
