# session 39, call 1, on an H200: the draft-model GPU tests (and the overlap GPU tests beside them), then the
# 8B-shaped bf16 and W4A16 (RTN g128) artifacts built for call 2's decode pair
source benchmarks/results/session27/artifacts.sh
log=$OUT/call1.log
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader | tee -a $log
timeout 300 python -P -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_spec_draft.py tests/runtime/test_overlap.py \
  2>&1 | tail -25 >> $log
echo "[+${SECONDS}s] tests done" >> $log
timeout $((560 - SECONDS)) bash -c "source benchmarks/results/session27/artifacts.sh; artifacts bf16 w4a16" > $OUT/build.log 2>&1
echo "[+${SECONDS}s] built: $(ls /tmp/llmc-pairs)" >> $log
cat $log; tail -5 $OUT/build.log
