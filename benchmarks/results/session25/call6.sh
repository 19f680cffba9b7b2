# session 25, call 6: w4a16_ws.PINGPONG with the turn passed at issue (each warpgroup issues once the other has issued: call 1's variant 0) against the stagger, the table's configs at 128-512
# tokens (its wgmma cells, which the switch does not touch, as the noise floor), three rounds alternating
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name --format=csv,noheader
cd benchmarks
python w4a16_switch_probe.py --json $OUT/pingpong_issue_table.json --switch w4a16_ws.PINGPONG --values 0 1 \
  --ms 128 256 512 --rounds 3 2>&1 | tee $OUT/pingpong_issue_table.log
python w4a16_switch_probe.py --json $OUT/pingpong_issue_128tiles.json --switch w4a16_ws.PINGPONG --values 0 1 \
  --ms 128 256 512 --configs wgmma_ws,128,128,1,4,5,1 wgmma_ws,128,128,2,4,5,1 --rounds 3 2>&1 | tee $OUT/pingpong_issue_128tiles.log
