# session 45, call 2, on an H200: W4A16 MoE end to end with the measured tiles (session 45's table) against the
# tiles chosen by reasoning (the tree with kernels/fused_moe.py as before: results/session45/fused_moe_before.py),
# a Qwen3-30B-A3B-shaped model (6 of 48 layers) built RTN W4A16 g128 once; decode and 128/128 throughput,
# the two trees alternating, two rounds
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
work=/tmp/s45; mkdir -p $work
old=/tmp/s45-before; rm -rf $old; mkdir -p $old
cp -r $repo/llmc $repo/compiler $repo/quant $repo/kernels $repo/runtime $old/
cp $repo/benchmarks/results/session45/fused_moe_before.py $old/kernels/fused_moe.py
bash $repo/benchmarks/package_dir.sh $old /tmp/llmcpkg-before
[ -f $work/ckpt/config.json ] || python $repo/benchmarks/make_checkpoint.py --out $work/ckpt --arch qwen3-moe --layers 6 2>&1 | tail -2
cat > $work/w4.yaml <<EOR
model: $work/ckpt
output: $work/moe-w4a16
dtype: bfloat16
quantization: {method: rtn, bits: 4, group_size: 128, symmetric: true}
runtime: {max_model_len: 4096, max_num_seqs: 256, max_num_batched_tokens: 8192}
target: {device: cuda, gpu_memory_gib: 141}
EOR
python -P -m llmc.cli build $work/w4.yaml -q 2>&1 | tail -3
echo "[+${SECONDS}s] built"
for r in 1 2; do
  for tree in now before; do
    pp=/tmp/llmcpkg; [ $tree = before ] && pp=/tmp/llmcpkg-before
    (cd /tmp && PYTHONPATH=$pp timeout 150 python $repo/benchmarks/bench_e2e.py "$work/moe-w4a16=w4a16-$tree" \
      --parts decode,throughput --throughput 128x128:1000 --time-limit 40 --json $OUT/e2e-moe-w4a16-$tree-r$r.json 2>&1 \
      | grep -E -- "^\||Error|error:" | tail -6)
    echo "[+${SECONDS}s] $tree r$r"
  done
done
