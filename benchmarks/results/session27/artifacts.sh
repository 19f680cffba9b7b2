# session 27: sourced by calls 4, 6 and 8 (folded after the session from the lines each had inline: the same commands;
# call 4 built its two artifacts one after the other, the others side by side). `artifacts Q...` makes the 8B-shaped
# checkpoint in $work/ckpt and the artifacts Q (bf16, fp8 or w4a16: RTN g128 symmetric, bench_8b.sh's W4) in $work/Q,
# each only if it is not there from an earlier call on the same machine.
repo=$PWD; work=/tmp/llmc-pairs; mkdir -p $work
source benchmarks/gpu_env.sh
artifacts() {
  [ -f $work/ckpt/config.json ] || python benchmarks/make_checkpoint.py --out $work/ckpt | tail -1
  local q quant
  for q in "$@"; do
    [ -f $work/$q/manifest.json ] && continue
    case $q in
      bf16) quant='{method: none}' ;;
      fp8) quant='{method: fp8}' ;;
      w4a16) quant='{method: rtn, bits: 4, group_size: 128, symmetric: true}' ;;
    esac
    printf 'model: %s/ckpt\noutput: %s/%s\ndtype: bfloat16\nquantization: %s\nruntime: {max_model_len: 4096, max_num_seqs: 256, max_num_batched_tokens: 8192}\ntarget: {device: cuda, gpu_memory_gib: 80}\n' \
      $work $work $q "$quant" > $work/$q.yaml
    (cd $work && python -m llmc.cli build $work/$q.yaml -q | tail -1) &
  done
  wait
}
