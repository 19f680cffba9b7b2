# session 27, call 1 (issue 12): after b9a384c (the detokenizer's empty final flush) and b6f9c3d (a step's logits in
# bf16): the engine's GPU tests; the bf16 run at max_num_seqs 1024 step by step and kernel by kernel (session 26 call 4:
# 7.242 s of kernels); one same-run pair against the engine before the overlap (73466ca, `git archive 73466ca | tar -x
# -C .baseline73`, its checkpoints/ removed)
repo=$PWD; old=$repo/.baseline73; work=/tmp/llmc-pairs; mkdir -p $work
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 300 python -P -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_overlap.py tests/runtime/test_cuda_graphs.py \
  tests/runtime/test_memory_plan.py tests/kernels/test_sampling.py tests/compiler/test_kernel_plan.py 2>&1 | tail -4 | tee $OUT/gpu_tests_runtime.log
python benchmarks/make_checkpoint.py --out $work/ckpt | tail -1
printf 'model: %s/ckpt\noutput: %s/bf16\ndtype: bfloat16\nquantization: {method: none}\nruntime: {max_model_len: 4096, max_num_seqs: 256, max_num_batched_tokens: 8192}\ntarget: {device: cuda, gpu_memory_gib: 80}\n' \
  $work $work > $work/bf16.yaml
(cd $work && python -m llmc.cli build $work/bf16.yaml -q | tail -1)
(cd /tmp && timeout 200 python $repo/benchmarks/profile_throughput.py "$work/bf16=bf16-1024@max_num_seqs=1024" --kernels --top 30 \
  --json $OUT/tprofile.json > $OUT/tprofile.log 2>&1); tail -45 $OUT/tprofile.log | cut -c1-200
(cd /tmp && python $repo/benchmarks/bench_e2e.py "$work/bf16=bf16-now-1024-r1@max_num_seqs=1024" \
  --parts throughput --throughput 128x128:1000 --time-limit 60 --json $OUT/e2e-bf16-now-r1.json 2>&1 | grep -E -- "->|Error|error:")
cp $work/bf16/manifest.json $work/manifest.json.keep  # the baseline drops keys its reader does not know, in place
bash $repo/benchmarks/baseline_e2e.sh $old $work/bf16 bf16-before-1024-r1 $OUT/e2e-bf16-before-r1.json \
  --parts throughput --throughput 128x128:1000 --time-limit 60 --max-num-seqs 1024 2>&1 | grep -E -- "->|Error|error:"
cp $work/manifest.json.keep $work/bf16/manifest.json
