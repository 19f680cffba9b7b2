# session 45, call 3, on two H200s of one host (nvidia-h200-x2, lent this session): the two-GPU tests (Qwen2-MoE's
# shared expert at tensor 2 and expert parallel 2, written in session 42 and never run), then tensor 1 against
# tensor 2 for the 8B-shaped W4A16 artifact with the ranks overlapped and in CUDA graphs (session 6's work, never
# measured on two GPUs): greedy agreement, batch-1 and batch-128 decode, 128/128 throughput, all-reduce time
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 150 python -P -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_more_families.py -k two_gpus 2>&1 | tail -6
echo "[+${SECONDS}s] tests done"
STAGE_LIMIT_S=400 timeout 430 bash benchmarks/bench_8b.sh tp $OUT 2>&1 | tail -40
echo "[+${SECONDS}s] done"
