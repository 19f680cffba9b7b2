# session 49, call 4: the GPU cases of Llama 4, MiniMax-M2 and ERNIE 4.5 MoE (its W4 case fixed after call 3), and the
# MoE families whose router-bias reading the merges touched (MoeSpec.score_bias): GLM-4.5, DeepSeek, GLM-4.5's MTP, the
# fused-kernel MoE families
source benchmarks/gpu_env.sh
export PYTHONPATH=$PYTHONPATH:$repo/benchmarks/results/session49
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 500 python -P -m pytest -p no:cacheprovider -p printfail -m gpu tests/runtime/test_llama4.py \
  tests/runtime/test_minimax_m2.py tests/runtime/test_ernie4_5_moe.py tests/runtime/test_glm4_moe.py \
  tests/runtime/test_deepseek.py tests/runtime/test_spec_mtp.py tests/runtime/test_more_families.py \
  -k "not long_prefills and not quantized_shared_expert and not two_gpus" -v --durations=10 > $OUT/pytest.log 2>&1
grep -E "FAILED|ERROR|passed|failed|^E " $OUT/pytest.log | head -40
tail -14 $OUT/pytest.log
echo "[+${SECONDS}s] tests done"
