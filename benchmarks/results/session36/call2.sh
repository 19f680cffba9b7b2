# session 36, call 2: act order end to end. An 8B-shaped checkpoint cut to 8 layers, made GPTQ act order
# (benchmarks/act_order_checkpoint.py: RTN g128 in a random column order per input, desc_act), built by the
# tree before this session's act-order changes (.base36 = git archive a80c088) and by this tree; batch-1
# decode of each artifact by its own tree (bench_e2e --parts decode), alternating, two rounds. Then the GPU
# tests of the changed parts (the norm's perm output, the identity perm, the act-order formats, graphs).
set -u
source benchmarks/gpu_env.sh
repo=$PWD
bash benchmarks/package_dir.sh .base36 /tmp/llmcpkg-before
log=$OUT/call2.log
say() { echo "[$(date +%H:%M:%S) +${SECONDS}s] $*" | tee -a $log; }
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader >> $log
cd /tmp
python $repo/benchmarks/make_checkpoint.py --layers 8 --out /tmp/ck8 >> $log 2>&1
python $repo/benchmarks/act_order_checkpoint.py /tmp/ck8 /tmp/ck8-act >> $log 2>&1
say "checkpoint ready"
for tree in now before; do
  pp=/tmp/llmcpkg; [ $tree = before ] && pp=/tmp/llmcpkg-before
  printf 'model: /tmp/ck8-act\noutput: /tmp/act-%s\nquantization:\n  method: import\ntarget:\n  device: cuda\n' $tree > /tmp/act-$tree.yaml
  PYTHONPATH=$pp python -m llmc.cli build /tmp/act-$tree.yaml >> $log 2>&1
  say "built $tree"
done
for round in 1 2; do
  for tree in now before; do
    pp=/tmp/llmcpkg; [ $tree = before ] && pp=/tmp/llmcpkg-before
    PYTHONPATH=$pp timeout 150 python $repo/benchmarks/bench_e2e.py /tmp/act-$tree=act-$tree-r$round --parts decode \
      --repeats 5 --json $OUT/decode-$tree-r$round.json 2>&1 | grep -E "^\|" >> $log
    say "decode $tree $round"
  done
done
cd $repo
timeout 200 python -P -m pytest -q -p no:cacheprovider -m gpu tests/kernels/test_fused_ops.py tests/quant/test_gpu_formats.py \
  tests/runtime/test_piecewise_graphs.py tests/runtime/test_cuda_graphs.py 2>&1 | tail -4 >> $log
say "gpu tests done"
