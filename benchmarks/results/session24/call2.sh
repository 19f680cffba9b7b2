# session 24 call 2: GPU tests of the W4A16 kernels with LIVE_OPERANDS, then the on/off probe
source benchmarks/gpu_env.sh
REPO=$(pwd)
timeout 240 python -P -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_w4a16.py -x 2>&1 | tail -4
cd benchmarks
timeout 200 python w4a16_live_operands_probe.py --json $OUT/live_table.json --ms 1 16 64 128 256 512 1024 4096 2>&1 | grep -v Warn
timeout 120 python w4a16_live_operands_probe.py --json $OUT/live_ws_qkv_o.json --ms 256 512 1024 4096 --shapes 4096x6144 4096x4096 \
  --configs wgmma_ws,128,128,1,4,5,1 wgmma_ws,256,128,1,4,3,1 wgmma_ws,128,128,2,4,5,1 wgmma,128,64,1,4,5,1 2>&1 | grep -v Warn
