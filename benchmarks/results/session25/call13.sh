# session 25, call 13: two more GPU cases for the TMA-store epilogue (fp16, a partial N tile, one K tile)
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python -P -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_w4a16.py -k "wgmma_kernel_matches" 2>&1 | tail -3 | tee $OUT/gpu_tests_call13.log
