# session 25, call 11: with the TMA-store epilogue, the warp-specialized 256-token tile against dequantize +
# cuBLAS (the heuristic's pick beyond 1024 tokens) on shapes outside the table, at 2048 and 4096 tokens
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
cd benchmarks
timeout 400 python w4a16_kind_sweep.py --json $OUT/beyond1024.json --shapes 5120x15360 13824x5120 3584x37888 1024x8192 \
  4096x6144 --ms 2048 4096 --configs wgmma_ws,256,128,1,4,3,1 dequant > $OUT/beyond1024.log 2>&1
python - $OUT/beyond1024.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
bf = {(r["K"], r["N"], r["M"]): r["bf16_us"] for r in d["rows"]}
for c in d["candidates"]:
    key = (c["K"], c["N"], c["M"])
    print(*key, c["config"]["kind"], c["us"], f'{bf[key] / c["us"]:.2f}x')
PY
