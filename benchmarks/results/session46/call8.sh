# session 46, call 8, on an H200: which part of gpt-oss's CUDA run is off (call 5: its logits far from transformers,
# while the sink kernels and the biased fused MoE pass alone): the model test with every kernel's torch path
# (not run: the device refused the call, too little time left to start a machine; call 7 had already shown the cause)
source benchmarks/gpu_env.sh
export PYTHONPATH=$PYTHONPATH:$repo/benchmarks/results/session46
for probe in all; do
  PROBE=$probe timeout 60 python -P -m pytest -p no:cacheprovider -p probe_plugin -m gpu tests/runtime/test_gpt_oss.py \
    -k "on_the_gpu and False" -q 2>&1 | grep -E "passed|failed|Greatest abs|^E  .*Error" | head -4
  echo "[+${SECONDS}s] $probe"
done
