# session 26, call 7 (issue 12): the same-run ratio again, bf16 at max_num_seqs 1024 (both engines' best, session 10),
# this tree at 256 and 1024 and the engine before the overlap (73466ca, `git archive 73466ca | tar -x -C .baseline73`, its checkpoints/ removed: the 64 MiB the device takes)
PARTS=throughput QUANTS=bf16 NOW_SEQS="1024" OLD_SEQS="1024" bash benchmarks/overlap_vs_before.sh .baseline73 $OUT
