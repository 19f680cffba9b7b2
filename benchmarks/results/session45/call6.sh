# session 45, call 6, on an H200: where the latent-MLA DeepSeek model's CUDA run makes an illegal memory access
# (call 4: test_deepseek.py::test_on_the_gpu), with CUDA_LAUNCH_BLOCKING=1 so the failing launch raises, and the
# failure's report printed at once (printfail.py: the abort at teardown lost it)
source benchmarks/gpu_env.sh
export PYTHONPATH=$PYTHONPATH:$repo/benchmarks/results/session45
CUDA_LAUNCH_BLOCKING=1 timeout 200 python -P -m pytest -p no:cacheprovider -p printfail -o log_cli=true --log-cli-level=WARNING -m gpu -x \
  "tests/runtime/test_deepseek.py::test_on_the_gpu[deepseek_v2]" > $OUT/pytest.log 2>&1
grep -v "site-packages" $OUT/pytest.log | grep -B3 -A40 "Traceback" | head -120
