# session 25, call 7: the one-warpgroup per-tile kernel (kind wgmma) on 128-token tiles with a shallow ring, so
# that two or three CTAs share an SM (5 stages, the tuner's only choice there, leave room for one), 256-4096 tokens
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
cd benchmarks
timeout 500 python w4a16_kind_sweep.py --json $OUT/shallow_sweep.json --ms 256 512 1024 4096 --configs \
  wgmma,128,64,1,4,5,1 wgmma,128,64,1,4,3,1 wgmma,128,64,1,4,2,1 wgmma,128,64,2,4,3,1 wgmma,64,64,1,4,3,1 \
  wgmma,64,128,1,4,3,1 wgmma,128,64,1,4,2,1,1 > $OUT/shallow_sweep.log 2>&1
tail -2 $OUT/shallow_sweep.log
python - $OUT/shallow_sweep.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
bf = {(r["K"], r["N"], r["M"]): (r["bf16_us"], r["table_us"], r["table"]) for r in d["rows"]}
cells = {}
for c in d["candidates"]:
    cfg = c["config"]
    cells.setdefault((c["K"], c["N"], c["M"]), []).append(
        (f'{cfg["block_m"]}x{cfg["block_n"]}s{cfg["split_k"]}st{cfg["num_stages"]}{"a" if cfg["scale_acc"] else ""}', c["us"]))
for key, cs in cells.items():
    b, t, tc = bf[key]
    print(f"{key[0]}x{key[1]} M={key[2]} bf16 {b:.1f} table({tc['kind']} {tc['block_m']}x{tc['block_n']}) {t:.1f} ({b/t:.2f}x) | " +
          " ".join(f"{n} {us:.1f} ({b/us:.2f}x)" for n, us in cs[1:]))
PY
