# session 25, call 14: the TMA-store epilogue in the one-warpgroup kernel too (unsplit tiles of 64 rows on 4 warps,
# the table's o at 129-256 tokens): its GPU tests, then w4a16_gluon.TMA_STORE off / on
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python -P -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_w4a16.py -k "wgmma_kernel_matches or every_w4a16_table or silu_mul" 2>&1 | tail -3 | tee $OUT/gpu_tests_call14.log
cd benchmarks
python w4a16_switch_probe.py --json $OUT/tma_store_wgmma.json --switch w4a16_gluon.TMA_STORE --values 0 1 \
  --ms 16 64 256 --configs wgmma,128,64,1,4,5,1 wgmma,64,64,1,4,4,1,1 wgmma,16,64,1,4,4,1,1 --rounds 3 2>&1 | tee $OUT/tma_store_wgmma.log
