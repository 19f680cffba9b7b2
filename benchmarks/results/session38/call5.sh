# session 38, call 5: the Triton W8A8 int8 kernels on a GPU: their GPU tests (bit for bit against the torch path at
# Llama-3-8B shapes), the format's and the tiny int8 artifact's GPU tests, then bench_int8.py (Triton and _int_mm
# beside bf16 and FP8 W8A8)
source benchmarks/gpu_env.sh
log=$OUT/call5.log
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $log
timeout 260 python -P -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_int8_triton.py tests/quant/test_int8.py \
  tests/compiler/test_int8_build.py 2>&1 | tail -15 >> $log
echo "[+${SECONDS}s] tests done" >> $log
timeout 150 python -P benchmarks/bench_int8.py --out $OUT >> $log 2>&1
echo "[+${SECONDS}s] done" >> $log
cat $log
