# session 38, call 4: the W8A8 int8 format on a GPU: its GPU tests (cuBLAS _int_mm against the CPU product, the
# sizes cuBLAS does not take, a tiny int8 artifact on CUDA against the CPU) and its speed against bf16 and FP8 W8A8
# on Llama-3-8B's shapes (benchmarks/bench_int8.py: bench_kernels' timer)
source benchmarks/gpu_env.sh
log=$OUT/call4.log
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $log
timeout 240 python -P -m pytest -q -p no:cacheprovider -m gpu tests/quant/test_int8.py tests/compiler/test_int8_build.py 2>&1 | tail -15 >> $log
echo "[+${SECONDS}s] tests done" >> $log
timeout 200 python -P benchmarks/bench_int8.py --out $OUT >> $log 2>&1
echo "[+${SECONDS}s] done" >> $log
cat $log
