# session 28, call 7: the device machine's host (no GPU work) running benchmarks/host_cost.py (ref-llama-12m on the
# CPU, constant logits, 256 rows, final-only outputs: the engine's phases per step and resolve's time per finished
# request), this tree and the tree before the session (69c8916) alternating; then profile_throughput.py --clocks on
# ref-llama-12m on the GPU (does the nvidia-smi sampling work there)
source benchmarks/gpu_env.sh
bash benchmarks/package_dir.sh $PWD/.baseline69 /tmp/before
# (python -m llmc.cli from the repo root would import the repo's own llmc/ folder, which lacks the package-dir mapping)
repo=$PWD; sed "s|^model: |model: $repo/|; s|^output: |output: $repo/|" recipes/ref-llama-12m.yaml > /tmp/ref.yaml
(cd /tmp && python -m llmc.cli build /tmp/ref.yaml -q 2>&1 | tail -2)
for round in 1 2; do
  for variant in before:/tmp/before now:/tmp/llmcpkg; do
    echo "${variant%%:*} $round"; PYTHONPATH=${variant#*:} python benchmarks/host_cost.py build/ref-llama-12m --batch 256 --output-kind final_only 2>&1 | grep -v "nanobind\|leaked\| - "
  done
done
(cd /tmp && timeout 120 python $repo/benchmarks/profile_throughput.py $repo/build/ref-llama-12m=ref --clocks --max-model-len 512 \
  --json $OUT/tprofile-ref-clocks.json 2>&1 | tail -4 | cut -c1-400)
