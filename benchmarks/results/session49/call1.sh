# session 49, call 1: the GPU cases session 48 wrote and did not run (EXAONE 4 / Seed-OSS / ERNIE 4.5, DeepSeek-V3's
# MTP, structured output at 0.4 + 0.4 of the GPU), then every -m gpu test under tests/compiler and tests/quant and
# the sampling kernels'
source benchmarks/gpu_env.sh
export PYTHONPATH=$PYTHONPATH:$repo/.gpu_deps:$repo/benchmarks/results/session49
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 560 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/runtime/test_exaone4_seed_ernie.py \
  tests/runtime/test_spec_mtp_deepseek.py tests/runtime/test_structured_output.py tests/compiler tests/quant \
  tests/kernels/test_sampling.py -v --durations=25 > $OUT/pytest.log 2>&1
grep -E "FAILED|ERROR|passed|failed|^E " $OUT/pytest.log | head -60
tail -30 $OUT/pytest.log
echo "[+${SECONDS}s] tests done"
