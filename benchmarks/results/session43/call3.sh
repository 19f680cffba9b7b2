# session 43, call 3, on an H200: the kernel table with cuBLAS's block-scaled GEMM above 16 tokens (the benchmark now
# derives the 128 x 128 scales as a loaded model does), with programmatic dependent launch on and off; the block
# build's GPU test again; then end to end on an 8-layer model of Llama-3.1-8B's widths: bf16, FP8 per channel and FP8
# in blocks, batch-1 decode and throughput 128/128, one bench_e2e run
source benchmarks/gpu_env.sh
timeout 100 python -P benchmarks/bench_fp8_block.py --json $OUT/bench_fp8_block_call3.json 2>&1 | grep "^|"
echo "[+${SECONDS}s] PDL on done"
LLMC_PDL=0 timeout 100 python -P benchmarks/bench_fp8_block.py --ms 1 4 16 64 --json $OUT/bench_fp8_block_call3_nopdl.json 2>&1 | grep "^|"
echo "[+${SECONDS}s] PDL off done"
timeout 120 python -P -m pytest -q -p no:cacheprovider -m gpu tests/quant/test_fp8_block.py 2>&1 | tail -4
echo "[+${SECONDS}s] tests done"
repo=$PWD; work=/tmp/s43; mkdir -p $work
[ -d $work/ck ] || python benchmarks/make_checkpoint.py --out $work/ck --layers 8 | tail -1
for q in bf16 fp8 fp8block; do
  case $q in bf16) qs="{method: none}";; fp8) qs="{method: fp8, report: false}";; fp8block) qs="{method: fp8, weights: block, report: false}";; esac
  printf 'model: %s/ck\noutput: %s/%s\ndtype: bfloat16\nquantization: %s\nruntime: {max_model_len: 1024, max_num_seqs: 256}\ntarget: {device: cuda}\n' $work $work $q "$qs" > $work/$q.yaml
  [ -d $work/$q ] || (cd $work && python -m llmc.cli build $work/$q.yaml -q | tail -1)
done
echo "[+${SECONDS}s] built"
(cd /tmp && timeout 280 python -P $repo/benchmarks/bench_e2e.py $work/bf16=bf16 $work/fp8=fp8 $work/fp8block=fp8-block \
  --parts decode,throughput --throughput 128x128:1000 --time-limit 40 --json $OUT/e2e_call3.json 2>&1 | tail -20)
echo "[+${SECONDS}s] done"
