# session 25, call 9: the warp-specialized kernel's tiles out by TMA stores (w4a16_ws.TMA_STORE): the GPU tests of
# test_w4a16.py, then on / off alternating on the table's configs and on the 256-token tile at 1024-4096 tokens
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 330 python -P -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_w4a16.py 2>&1 | tail -4 | tee $OUT/gpu_tests_tma_store.log
cd benchmarks
python w4a16_switch_probe.py --json $OUT/tma_store_table.json --switch w4a16_ws.TMA_STORE --values 0 1 \
  --ms 128 256 512 1024 4096 --rounds 3 2>&1 | tee $OUT/tma_store_table.log
python w4a16_switch_probe.py --json $OUT/tma_store_ws256.json --switch w4a16_ws.TMA_STORE --values 0 1 \
  --ms 1024 4096 --configs wgmma_ws,256,128,1,4,3,1 --rounds 3 2>&1 | tee $OUT/tma_store_ws256.log
