# session 27, call 7: call 6 again, after profile_step.py counts the time some kernel runs (the union of the kernels'
# intervals) instead of summing their durations. In call 6 FP8 showed kernel time above the wall time (GPU busy
# 1.26-1.78): its Triton GEMMs launch with programmatic dependent launch and wait beside the kernel before them.
# (Folded after the session: call 7 ran call6.sh's lines with kernel_sum_ms also printed.)
KEYS="'kernel_ms', 'kernel_sum_ms', 'gpu_busy'" bash benchmarks/results/session27/call6.sh
