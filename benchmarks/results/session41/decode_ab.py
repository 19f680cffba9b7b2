"""Session 41: batch-1 decode and 512-token prompt tokens/s of onnx-cpu artifacts (bench_onnx.py's worker: 64 tokens
after a 32-token prompt, best of 5; prefill best of 3), the artifacts in turn, three rounds, in one process.

    python -P benchmarks/results/session41/decode_ab.py ARTIFACT [ARTIFACT ...]

Used on ref-llama-12m builds (float32, runtime.max_model_len 2048; unquantized, and RTN W4 g128) made by the tree
before session 41 (graph outputs: logits and the KV) and after it (hidden_states too).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from transformers import AutoTokenizer  # noqa: E402

from benchmarks import bench_onnx  # noqa: E402

ids = AutoTokenizer.from_pretrained(str(bench_onnx.REPO / "checkpoints" / "ref-llama-12m")).encode(
    bench_onnx.HELDOUT.read_text())
results = {path: [] for path in sys.argv[1:]}
for _ in range(3):
    for path in results:
        results[path].append(bench_onnx._llmc_worker(path, ids, False))
for path, rows in results.items():
    print(path, "decode tok/s", [round(r["decode_tps"]) for r in rows], "prompt tok/s", [round(r["prompt_tps"]) for r in rows])
