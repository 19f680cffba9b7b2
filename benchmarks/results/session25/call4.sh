# session 25, call 4: 256 weight rows per tile (the activations read from L2 half as often per product) in the
# warp-specialized and stream-K kernels: GPU tests of the new cases, then against the 128-row tiles and the table
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 240 python -P -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_w4a16.py -k "wgmma_kernel_matches and (ws or sk) or stream_k" 2>&1 | tail -4 | tee $OUT/gpu_tests_256rows.log
cd benchmarks
timeout 420 python w4a16_kind_sweep.py --json $OUT/rows256_sweep.json --ms 256 512 1024 4096 --configs \
  wgmma_ws,256,128,1,4,3,1 wgmma_ws,128,256,1,4,4,1 wgmma_ws,128,256,2,4,4,1 wgmma_sk,128,256,1,4,4,1 \
  wgmma_ws,64,256,1,4,6,1 wgmma_ws,64,256,2,4,6,1 > $OUT/rows256_sweep.log 2>&1
tail -2 $OUT/rows256_sweep.log
python - $OUT/rows256_sweep.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
bf = {(r["K"], r["N"], r["M"]): (r["bf16_us"], r["table_us"], r["table"]["kind"]) for r in d["rows"]}
cells = {}
for c in d["candidates"]:
    cfg = c["config"]
    cells.setdefault((c["K"], c["N"], c["M"]), []).append(
        (f'{cfg["kind"][6:] or "gm"}{cfg["block_m"]}x{cfg["block_n"]}s{cfg["split_k"]}', c["us"], c["error"]))
for key, cs in cells.items():
    b, t, tk = bf[key]
    print(f"{key[0]}x{key[1]} M={key[2]} bf16 {b:.1f} table({tk}) {t:.1f} ({b/t:.2f}x) | " +
          " ".join(f"{n} {us:.1f} ({b/us:.2f}x)" for n, us, e in cs[1:]), "maxerr %.1e" % max(e for _, _, e in cs))
PY
