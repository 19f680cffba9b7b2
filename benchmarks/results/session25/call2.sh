# session 25, call 2: the persistent stream-K kernel (kind wgmma_sk): GPU tests, then against wgmma_ws and the table
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 python -P -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_w4a16.py -k "sk or stream_k" 2>&1 | tail -15 | tee $OUT/gpu_tests_sk.log
cd benchmarks
timeout 400 python w4a16_kind_sweep.py --json $OUT/sk_sweep.json --ms 128 256 512 1024 4096 --configs \
  wgmma_ws,128,128,1,4,5,1 wgmma_ws,256,128,1,4,3,1 wgmma_sk,128,128,1,4,5,1 wgmma_sk,256,128,1,4,3,1 > $OUT/sk_sweep.log 2>&1
tail -3 $OUT/sk_sweep.log
python - $OUT/sk_sweep.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
bf = {(r["K"], r["N"], r["M"]): (r["bf16_us"], r["table_us"], r["table"]["kind"]) for r in d["rows"]}
cells = {}
for c in d["candidates"]:
    key = (c["K"], c["N"], c["M"])
    cfg = c["config"]
    cells.setdefault(key, []).append((f'{cfg["kind"][6:] or "gm"}{cfg["block_m"]}', c["us"], c["error"]))
for key, cs in cells.items():
    b, t, tk = bf[key]
    print(f"{key[0]}x{key[1]} M={key[2]} bf16 {b:.1f} table({tk}) {t:.1f} ({b/t:.2f}x) | " +
          " ".join(f"{n} {us:.1f} ({b/us:.2f}x)" for n, us, e in cs[1:]), "maxerr %.1e" % max(e for _, _, e in cs))
PY
