# session 27, call 4 (issues 12 and 13): batch-1 decode after b6f9c3d (the step's logits stay bf16): the W4A16
# artifact (RTN g128 symmetric, bench_8b.sh's W4) beside gpt-fast int4 in the same call, and the bf16 artifact (issue
# 12's "no worse than 6.9 ms/token"); on call 1's checkpoint and bf16 artifact (made again on a fresh machine)
repo=$PWD; work=/tmp/llmc-pairs; mkdir -p $work
source benchmarks/gpu_env.sh
[ -f $work/ckpt/config.json ] || python benchmarks/make_checkpoint.py --out $work/ckpt | tail -1
for q in bf16 w4a16; do
  [ -f $work/$q/manifest.json ] && continue
  quant='{method: none}'; [ $q = w4a16 ] && quant='{method: rtn, bits: 4, group_size: 128, symmetric: true}'
  printf 'model: %s/ckpt\noutput: %s/%s\ndtype: bfloat16\nquantization: %s\nruntime: {max_model_len: 4096, max_num_seqs: 256, max_num_batched_tokens: 8192}\ntarget: {device: cuda, gpu_memory_gib: 80}\n' \
    $work $work $q "$quant" > $work/$q.yaml
  (cd $work && python -m llmc.cli build $work/$q.yaml -q | tail -1)
done
timeout 200 python benchmarks/gptfast_int4.py $work/ckpt --json $OUT/gptfast-int4.json 2>&1 | tail -3
(cd /tmp && timeout 240 python $repo/benchmarks/bench_e2e.py "$work/w4a16=w4a16" "$work/bf16=bf16" --parts decode \
  --json $OUT/e2e-decode.json --budget 220 2>&1 | grep -v "^\[" | tail -25)
