# session 41, call 5, on an H200: image-prompt throughput of a LLaVA-1.5-7B-shaped artifact (CLIP ViT-L/14-336, 8 decoder
# layers of Llama-2-7B's widths, bf16, random weights) against transformers (after batching the image encoding in LLM.generate)
source benchmarks/gpu_env.sh
repo=$PWD; work=/tmp/s41; mkdir -p $work
[ -d $work/llava ] || (cd /tmp && python -P $repo/benchmarks/bench_vision.py make $work/llava --text-layers 8 2>&1 | tail -1)
printf 'model: %s/llava\noutput: %s/llava_bf16\ndtype: bfloat16\nruntime: {max_model_len: 2048, max_num_seqs: 64}\ntarget: {device: cuda}\n' $work $work > $work/llava.yaml
[ -d $work/llava_bf16 ] || (cd $work && python -m llmc.cli build $work/llava.yaml -q | tail -1)
echo "[+${SECONDS}s] built"
for n in 8 32; do
(cd /tmp && timeout 240 python -P $repo/benchmarks/bench_vision.py run $work/llava_bf16 --checkpoint $work/llava --num-prompts $n \
  --max-tokens 64 --repeats 2 --option gpu_memory_utilization=0.4 --json $OUT/vision5_$n.json 2>&1 | grep -E "^llmc|^transformers|Error|error")
done
echo "[+${SECONDS}s] done"
