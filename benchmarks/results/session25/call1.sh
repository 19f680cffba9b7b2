# session 25, call 1: w4a16_ws.PINGPONG (the warpgroups take turns at every tile) against the stagger (-1)
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
cd benchmarks
python w4a16_switch_probe.py --json $OUT/pingpong.json --switch w4a16_ws.PINGPONG --values -1 0 1 2 4 \
  --ms 256 1024 4096 --configs wgmma_ws,128,128,1,4,5,1 wgmma_ws,256,128,1,4,3,1 --rounds 2 2>&1 | tee $OUT/pingpong.log
