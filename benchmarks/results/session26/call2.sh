# session 26, call 2: the warp-specialized kernel's launch order (w4a16_ws.GROUP_M: token tiles per launch group,
# 1 = the grid's order) at 512-4096 tokens, values alternating in one process, best of two rounds
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
cd /tmp
timeout 420 python $OLDPWD/benchmarks/w4a16_switch_probe.py --switch w4a16_ws.GROUP_M --values 1 2 4 8 16 \
  --ms 512 1024 4096 --configs wgmma_ws,256,128,1,4,3,1 wgmma_ws,128,128,1,4,5,1 --rounds 2 \
  --json $OUT/group_m_probe.json > $OUT/group_m_probe.log 2>&1; echo "rc=$?"; grep -v Warning $OUT/group_m_probe.log | tail -30
