# session 27, call 3: call2.sh (fixed) for rounds 3 and 4
ROUNDS="3 4" bash benchmarks/results/session27/call2.sh
