# session 35, call 1: the session's GPU tests (every GPU test of tests/runtime but the server and structured-output
# modules, whose imports the GPU machine lacks, with the attention, fused-MoE, sampling and GPU-format tests and the
# long-context and knob tests) while the 8B-shaped W4A16 artifact builds; then the memory the graphs of prefill and
# mixed steps take on it (never measured correctly for W4A16), in FULL_AND_PIECEWISE and FULL, from the engine's
# own log line (graph bytes against the plan's allowance).
source benchmarks/results/session27/artifacts.sh
log=$OUT/call1.log
say() { echo "[$(date +%H:%M:%S) +${SECONDS}s] $*" | tee -a $log; }
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $log
(artifacts w4a16 > $work/artifacts.log 2>&1) &
say "gpu tests (artifact building)"
timeout 360 python -P -m pytest -q -p no:cacheprovider -m gpu tests/runtime --ignore=tests/runtime/server \
  --ignore=tests/runtime/test_structured_output.py tests/kernels/test_attention.py tests/kernels/test_fused_moe.py \
  tests/kernels/test_sampling.py tests/quant/test_gpu_formats.py tests/compiler 2>&1 | tail -15 >> $log
say "gpu tests done"
wait
say "built"; grep -E "^time|rror" $work/artifacts.log >> $log
for mode in FULL_AND_PIECEWISE FULL; do
  (cd /tmp && timeout 150 python -P - $work/w4a16 $mode <<'PY' 2>&1 | grep -E "CUDA graphs|memory plan|KV cache|rror|generated" | tee -a $log)
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
with LLM(sys.argv[1], compilation_config={"cudagraph_mode": sys.argv[2]}) as llm:
    out = llm.generate(["hello " * 300], SamplingParams(max_tokens=4, temperature=0))
    print("generated", len(out[0].outputs[0].token_ids), "tokens in", sys.argv[2], file=sys.stderr)
PY
  say "$mode done"
done
