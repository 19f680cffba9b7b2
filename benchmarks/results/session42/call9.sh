# session 42, call 9, on an H200: after the piecewise graphs took rows: the GPU tests of the row paths (prompts given as
# embeddings, Gemma 3 vision with key limits, LLaVA, the piecewise-graph tests), then call 6's measure again
source benchmarks/gpu_env.sh
repo=$PWD; work=/tmp/s42; mkdir -p $work
timeout 260 python -P -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_prompt_embeds.py \
  tests/runtime/test_gemma3_vision.py tests/runtime/test_llava.py tests/runtime/test_piecewise_graphs.py 2>&1 | tail -4
echo "[+${SECONDS}s] tests done"
[ -d $work/ck ] || python benchmarks/make_checkpoint.py --out $work/ck --layers 8 | tail -1
printf 'model: %s/ck\noutput: %s/bf16\ndtype: bfloat16\nquantization: {method: none}\nruntime: {max_model_len: 1024, max_num_seqs: 256, max_num_batched_tokens: 8192}\ntarget: {device: cuda}\n' $work $work > $work/r.yaml
[ -d $work/bf16 ] || (cd $work && python -m llmc.cli build $work/r.yaml -q | tail -1)
(cd /tmp && timeout 200 python -P $repo/benchmarks/bench_prompt_embeds.py $work/bf16 --device cuda --repeats 3 \
  --option gpu_memory_utilization=0.5 --json $OUT/prompt_embeds.json 2>&1 | grep -E "^TTFT|^throughput|Error|error")
echo "[+${SECONDS}s] done"
