# session 24 call 4: GPU tests of ed34ab5's kernels; the heuristic's 64-token tile against the scale on the products
source benchmarks/gpu_env.sh
timeout 300 python -P -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_w4a16.py tests/quant/test_gpu_formats.py > $OUT/gpu_tests.log 2>&1
tail -3 $OUT/gpu_tests.log
cd benchmarks
timeout 240 python w4a16_heuristic_check.py --json $OUT/heuristic_m64.json --ms 64 \
  --shapes 5120x15360 13824x5120 3584x37888 1024x8192 4096x6144 4096x4096 4096x28672 14336x4096 2>&1 | grep -v Warn
