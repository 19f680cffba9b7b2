# session 36, call 1: act order with down's gather folded away (order_down_groups): the W4A16 act-order cost
# per linear (down's row: w4a16_act_order is what down ran before, w4a16 what it runs now), then every GPU
# test of tests/runtime (but the server and structured-output modules) with the attention, fused-MoE,
# sampling, GPU-format and W4A16 act-order tests.
source benchmarks/gpu_env.sh
log=$OUT/call1.log
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $log
timeout 150 python -P benchmarks/act_order_cost.py --json $OUT/act_order_cost.json 2>&1 | tail -20 >> $log
echo "[+${SECONDS}s] act_order_cost done" >> $log
timeout 400 python -P -m pytest -q -p no:cacheprovider -m gpu tests/runtime --ignore=tests/runtime/server \
  --ignore=tests/runtime/test_structured_output.py tests/kernels/test_attention.py tests/kernels/test_fused_moe.py \
  tests/kernels/test_sampling.py tests/quant/test_gpu_formats.py 2>&1 | tail -25 >> $log
echo "[+${SECONDS}s] gpu tests done" >> $log
timeout 30 python -P -m pytest -q -p no:cacheprovider tests/compiler/test_order_down_groups.py 2>&1 | tail -3 >> $log
