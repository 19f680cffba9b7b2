# session 29, call 2: call 1 again with the row quantized from one load (one [heads, head_dim] tile instead of
# two passes of 16-head tiles); plus the decode kernel's registers and spills per compiled variant.
source benchmarks/results/session27/artifacts.sh
bash benchmarks/package_dir.sh $repo/.baseline89 /tmp/before
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
(timeout 300 python -P -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_attention.py -k "rotates or quantizes" \
  > $OUT/gpu_tests.log 2>&1; echo "exit $?" >> $OUT/gpu_tests.log
 python -P - > $OUT/decode_regs.txt 2>&1 <<'PY'
import torch
from llmc.kernels import attention_triton as at
dev = torch.device("cuda")
for batch in (1, 256):
    nb = batch * 16 + 8
    kc = torch.randn(nb, 16, 8, 128, device=dev, dtype=torch.bfloat16); vc = torch.randn_like(kc)
    bt = torch.arange(batch * 16, device=dev, dtype=torch.int32).view(batch, 16)
    ctx = torch.full((batch,), 200, device=dev, dtype=torch.int32)
    for fp8 in (False, True):
        qkv = torch.randn(batch, 48 * 128, device=dev, dtype=torch.bfloat16)
        q, k, v = [t.view(batch, -1, 128) for t in qkv.split([4096, 1024, 1024], -1)]
        cs = torch.randn(4096, 128, device=dev)
        pos = torch.full((batch,), 199, device=dev); slots = bt[:, 12].long() * 16 + 7
        at.paged_attention(q, kc, vc, bt, ctx, [1] * batch, 0.088, None, 4096, rotary=(k, v, pos, cs, slots), fp8_output=fp8)
torch.cuda.synchronize()
for dev_key, entry in at._decode_kernel.device_caches.items():
    for key, kern in entry[0].items():
        print("n_regs", kern.n_regs, "spills", kern.n_spills, "shared", kern.metadata.shared, str(key)[-160:])
PY
) &
artifacts fp8
wait; tail -3 $OUT/gpu_tests.log; cat $OUT/decode_regs.txt | cut -c1-60
for round in 1 2; do
  for variant in before:/tmp/before now:/tmp/llmcpkg; do
    v=${variant%%:*}
    (cd /tmp && PYTHONPATH=${variant#*:} timeout 90 python $repo/benchmarks/bench_e2e.py "$work/fp8=fp8-$v-decode-r$round" \
      --parts decode --json $OUT/e2e-fp8-decode-$v-r$round.json 2>&1 | grep -E -- "->|Error|error:")
  done
done
for variant in before:/tmp/before now:/tmp/llmcpkg; do
  v=${variant%%:*}
  (cd /tmp && PYTHONPATH=${variant#*:} timeout 120 python $repo/benchmarks/bench_e2e.py "$work/fp8=fp8-$v-1024-r1@max_num_seqs=1024" \
    --parts throughput --throughput 128x128:1000 --time-limit 60 --json $OUT/e2e-fp8-$v-r1.json 2>&1 | grep -E -- "->|Error|error:")
done
