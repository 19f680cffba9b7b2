# session 29, call 5: the decode kernel's tile and pipeline depth on an FP8 (e4m3) cache, deeper than session 9's
# sweep went (stages 2-3): is the FP8-cache kernel short of bytes in flight?
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
python -P benchmarks/decode_attention_sweep.py --caches float8_e4m3fn --block-n 16 32 64 --warps 4 8 --stages 3 4 5 6 \
  --json $OUT/decode_attention_sweep_fp8.json 2>&1 | tail -12
