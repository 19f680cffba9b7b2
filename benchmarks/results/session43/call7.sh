# session 43, call 7, on an H200: the GPU tests after the layouts' split (per-row scales a copy for cuBLAS, blocks
# only for a multiple of 4 groups); the kernel table; end to end bf16 / fp8 / fp8-block (8-layer 8B widths)
source benchmarks/gpu_env.sh
timeout 150 python -P -m pytest -q -p no:cacheprovider -m gpu tests/quant/test_fp8_block.py tests/kernels/test_fused_ops.py \
  -k "block or group" 2>&1 | grep -E "^E  |passed|failed" | head -20
echo "[+${SECONDS}s] tests done"
timeout 110 python -P benchmarks/bench_fp8_block.py --ms 1 4 16 37 64 256 1024 4096 --json $OUT/bench_fp8_block_call7.json 2>&1 | grep "^|"
echo "[+${SECONDS}s] bench done"
repo=$PWD; work=/tmp/s43; mkdir -p $work
[ -d $work/ck ] || python benchmarks/make_checkpoint.py --out $work/ck --layers 8 | tail -1
for q in bf16 fp8 fp8block; do
  case $q in bf16) qs="{method: none}";; fp8) qs="{method: fp8, report: false}";; fp8block) qs="{method: fp8, weights: block, report: false}";; esac
  printf 'model: %s/ck\noutput: %s/%s\ndtype: bfloat16\nquantization: %s\nruntime: {max_model_len: 1024, max_num_seqs: 256}\ntarget: {device: cuda}\n' $work $work $q "$qs" > $work/$q.yaml
  [ -d $work/$q ] || (cd $work && python -m llmc.cli build $work/$q.yaml -q | tail -1)
done
(cd /tmp && timeout 200 python -P $repo/benchmarks/bench_e2e.py $work/bf16=bf16 $work/fp8=fp8 $work/fp8block=fp8-block \
  --parts decode,throughput --throughput 128x128:1000 --time-limit 40 --json $OUT/e2e_call7.json 2>&1 | grep -E "^\||Error|failed")
echo "[+${SECONDS}s] done"
