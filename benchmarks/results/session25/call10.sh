# session 25, call 10: the TMA-store epilogue through the next-to-last tile's stage (call 9 used the last one's):
# the warp-specialized GPU tests, on / off on the 256-token tile, and the tile against the dequantize + cuBLAS
# entries at 1024 and 4096 tokens in one run
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python -P -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_w4a16.py -k "wgmma_kernel_matches and ws or every_w4a16_table or silu_mul" 2>&1 | tail -3 | tee $OUT/gpu_tests_call10.log
cd benchmarks
python w4a16_switch_probe.py --json $OUT/tma_store2_ws256.json --switch w4a16_ws.TMA_STORE --values 0 1 \
  --ms 1024 4096 --configs wgmma_ws,256,128,1,4,3,1 --rounds 3 2>&1 | tee $OUT/tma_store2_ws256.log
timeout 200 python w4a16_kind_sweep.py --json $OUT/ws256_vs_dequant.json --ms 1024 4096 --configs \
  wgmma_ws,256,128,1,4,3,1 dequant > $OUT/ws256_vs_dequant.log 2>&1
grep "M=" $OUT/ws256_vs_dequant.log
python - $OUT/ws256_vs_dequant.json <<'PY'
import json, sys
for c in json.load(open(sys.argv[1]))["candidates"]:
    print(c["K"], c["N"], c["M"], c["config"]["kind"], c["config"]["block_m"], c["us"])
PY
