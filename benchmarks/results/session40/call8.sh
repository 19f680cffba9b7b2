# session 40, call 8, on an H200: the engine's GPU tests after this session's changes to the runner (forward_hidden,
# the decode graphs keyed by LoRA on/off, pooling steps): overlap, piecewise graphs, memory plan, draft model,
# float32 against transformers (the structured-output tests need jsonschema, absent there)
source benchmarks/gpu_env.sh
timeout 400 python -P -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_overlap.py tests/runtime/test_piecewise_graphs.py \
  tests/runtime/test_memory_plan.py tests/runtime/test_spec_draft.py \
  tests/runtime/test_hf_equivalence.py 2>&1 | tail -6
echo "[+${SECONDS}s] done"
