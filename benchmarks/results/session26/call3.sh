# session 26, call 3: the re-recorded table (qkv at 513-1024 tokens and gate_up beyond 1024 on the warp-specialized
# tiles): the Done-means kernel table (bench_kernels), then the W4A16 and GPU-format tests
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
(cd /tmp && timeout 200 python $OLDPWD/benchmarks/bench_kernels.py --out $OUT > $OUT/bench_kernels.log 2>&1; tail -45 $OUT/bench_kernels.log)
timeout 330 python -P -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_w4a16.py tests/quant/test_gpu_formats.py 2>&1 | tail -4 | tee $OUT/gpu_tests_final.log
