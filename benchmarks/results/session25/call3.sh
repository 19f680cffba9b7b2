# session 25, call 3: where the warp-specialized kernel's warps stall, per SASS instruction (Nsight Compute
# source counters): 128-token tiles on o at 1024 tokens, 256-token tiles on o at 4096
source benchmarks/gpu_env.sh
cd benchmarks
ncu --version | tail -1
run() {  # M K N config name
  timeout 200 ncu --clock-control none -k regex:_w4a16_ws --launch-skip 2 --launch-count 1 \
    --section SourceCounters --section WarpStateStats --section SpeedOfLight -o $OUT/$5 -f \
    python w4a16_ncu_probe.py $1 $2 $3 $4 > $OUT/$5.log 2>&1
  ncu -i $OUT/$5.ncu-rep --page source --csv --print-source sass > $OUT/$5_source.csv 2> $OUT/$5_source.err
  ncu -i $OUT/$5.ncu-rep --page details > $OUT/$5_details.txt 2>&1
  python ncu_sass_stalls.py $OUT/$5_source.csv --top 45 > $OUT/$5_stalls.txt 2>&1
  head -c 200 $OUT/$5_source.err; head -60 $OUT/$5_stalls.txt | cut -c1-230
}
run 1024 4096 4096 wgmma_ws,128,128,1,4,5,1 ws128_o1024
run 4096 4096 4096 wgmma_ws,256,128,1,4,3,1 ws256_o4096
