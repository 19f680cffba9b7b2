REPO=$(pwd)
set -x
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
cd /tmp
timeout 300 python $REPO/benchmarks/bench_kernels.py --out $OUT 2>&1 | tail -60
cd $REPO/benchmarks
for spec in "256 4096 6144 wgmma_ws,128,128,1,4,5,1" "4096 4096 4096 wgmma_ws,256,128,1,4,3,1" "256 4096 4096 wgmma_ws,128,128,1,4,5,1"; do
  set -- $spec
  timeout 120 ncu --clock-control none -k regex:w4a16 --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
    python w4a16_ncu_probe.py $1 $2 $3 $4 > $OUT/ncu_$1_$3_${4%%,*}.txt 2>&1
  grep -E "Duration|Stall|Throughput|Warp Cycles|Issued|Registers|Eligible|Active Warps" $OUT/ncu_$1_$3_${4%%,*}.txt | head -40
done
