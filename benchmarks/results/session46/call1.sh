# session 46, call 1, on an H200: session 45's unrun call 7 (the decode graphs' capture clears the warm-up's kernel
# cache: DeepSeek's latent MLA on CUDA; the GGUF Q4_0 import on CUDA; the CUDA-graph tests), EAGLE on CUDA with
# CUDA graphs (new: the graphs keep the head's hidden states) and without, and EAGLE's decode speed on ref-llama-12m
source benchmarks/gpu_env.sh
export PYTHONPATH=$PYTHONPATH:$repo/.gpu_deps:$repo/benchmarks/results/session46
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 260 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/runtime/test_deepseek.py \
  tests/compiler/test_gguf.py tests/runtime/test_cuda_graphs.py tests/runtime/test_spec_eagle.py \
  tests/runtime/test_piecewise_graphs.py -v > $OUT/pytest.log 2>&1
grep -E "PASSED|FAILED|ERROR|passed|failed|^E " $OUT/pytest.log | head -60
echo "[+${SECONDS}s] tests done"
timeout 90 python -P -m llmc.cli build recipes/ref-llama-12m.yaml --output /tmp/ref12 -q > $OUT/build.log 2>&1
tail -3 $OUT/build.log
for mode in graphs eager; do
  opt=(); sizes="1 8"; [ $mode = eager ] && opt=(--option enforce_eager=true) && sizes=1
  timeout 150 python -P benchmarks/bench_spec_draft.py /tmp/ref12 --method eagle3 --draft checkpoints/eagle3-ref-llama-12m \
    --ks 1 3 --batch-sizes $sizes --repeats 2 --prompt-file data/heldout.txt --prompt-tokens 64 --tokens 64 "${opt[@]}" \
    --json $OUT/eagle_ref12_$mode.json 2>&1 | grep -E "^B=|Error|error" | head -20
  echo "[+${SECONDS}s] bench $mode done"
done
