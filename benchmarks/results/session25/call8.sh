# session 25, call 8: call 7's one gain over the table (qkv at 512 tokens: the one-warpgroup 128 x 64 tile on a
# 2-stage ring, 2-3 CTAs per SM) again, across the entry's range, twice
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
cd benchmarks
for round in 1 2; do
  timeout 250 python w4a16_kind_sweep.py --json $OUT/qkv512_round$round.json --ms 300 384 512 --configs \
    wgmma_ws,256,128,1,4,3,1 wgmma,128,64,1,4,2,1 wgmma,128,64,1,4,3,1 > $OUT/qkv512_round$round.log 2>&1
  python - $OUT/qkv512_round$round.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for c in d["candidates"]:
    if c["N"] == 6144 or (c["N"] == 4096 and c["K"] == 4096):
        cfg = c["config"]
        print(c["K"], c["N"], c["M"], cfg["kind"], cfg["block_m"], cfg["block_n"], cfg["num_stages"], c["us"])
PY
done
