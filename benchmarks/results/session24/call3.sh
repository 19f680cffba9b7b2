# session 24 call 3: GPU tests with LIVE_OPERANDS narrowed to the per-tile order without scale_acc; per-tile
# configs at 128/256 tokens against the table's
source benchmarks/gpu_env.sh
timeout 240 python -P -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_w4a16.py 2>&1 | tail -3
cd benchmarks
timeout 300 python w4a16_live_operands_probe.py --json $OUT/live_per_tile.json --ms 128 256 --configs \
  wgmma,128,64,1,4,5,1 wgmma,128,64,2,4,5,1 wgmma,128,128,1,8,4,1 wgmma,128,128,2,8,4,1 wgmma,128,64,4,4,5,1 \
  wgmma,128,64,2,4,4,1,1 wgmma_ws,128,128,1,4,5,1 wgmma_ws,128,128,2,4,5,1 wgmma_ws,128,128,4,4,5,1 2>&1 | grep -v Warn
