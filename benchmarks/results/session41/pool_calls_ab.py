"""Session 41: onnx-cpu pooling steps with chunks batched into calls (OnnxRunner._pool_calls) at several
MAX_POOL_CALL_ROWS, against one call per chunk (what execute does for prefill chunks): one engine, the modes
alternating round by round, 64 prompts of --length random tokens, median of 7 rounds after a warm-up round.

    python -P benchmarks/results/session41/pool_calls_ab.py ONNX_ARTIFACT [--length 128] [--caps 256 512 768]
"""

import argparse
import random
import statistics
import time

from llmc.runtime import onnx_runner
from llmc.runtime.llm import LLM

parser = argparse.ArgumentParser()
parser.add_argument("artifact")
parser.add_argument("--length", type=int, default=128)
parser.add_argument("--num-prompts", type=int, default=64)
parser.add_argument("--caps", type=int, nargs="+", default=[256, 512, 768])
args = parser.parse_args()
rng = random.Random(args.length)
llm = LLM(args.artifact, device="cpu", runner="pooling", disable_log_stats=True, enable_prefix_caching=False)
prompts = [{"prompt_token_ids": [rng.randrange(100, 4000) for _ in range(args.length)]} for _ in range(args.num_prompts)]
runner, batched = llm.engine.runner, llm.engine.runner._pool_calls
modes = {"one call per chunk": (lambda chunks: [[i] for i in range(len(chunks))], None)}
modes |= {f"batched, MAX_POOL_CALL_ROWS {cap}": (batched, cap) for cap in args.caps}
seconds = {mode: [] for mode in modes}
default_cap = onnx_runner.MAX_POOL_CALL_ROWS
for round_ in range(8):
    for mode, (calls, cap) in modes.items():
        runner._pool_calls, onnx_runner.MAX_POOL_CALL_ROWS = calls, cap or default_cap
        start = time.perf_counter()
        llm.embed(prompts)
        if round_:  # the first round warms up
            seconds[mode].append(time.perf_counter() - start)
tokens = args.num_prompts * args.length
print(f"L={args.length}: " + "; ".join(f"{mode} {tokens / statistics.median(t):.0f}" for mode, t in seconds.items())
      + " tokens/s")
llm.close()
