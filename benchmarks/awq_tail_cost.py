"""What AWQ's model-loss choice (pipeline.ModelTail) costs at build time: the same AWQ recipe built
with the tail and without it (variants then chosen by the layer's output error), timed.

    python benchmarks/awq_tail_cost.py --model CHECKPOINT --calib TEXT --out DIR [--num-samples 128]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from llmc.compiler import pipeline
from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict


def timed_build(model: str, calib: str, out: Path, num_samples: int) -> float:
    recipe = recipe_from_dict({
        "model": model, "output": str(out), "target": {"device": "cuda"},
        "quantization": {"method": "awq", "bits": 4, "group_size": 128, "symmetric": False, "report": False,
                         "calibration": {"data": calib, "num_samples": num_samples, "seq_len": 512}},
    })
    start = time.perf_counter()
    build(recipe, show_progress=False)
    return round(time.perf_counter() - start, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--calib", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--num-samples", type=int, default=128)
    args = parser.parse_args()
    result = {"with_tail_s": timed_build(args.model, args.calib, args.out / "tail", args.num_samples)}
    print(json.dumps(result), flush=True)
    real_tail = pipeline.ModelTail
    pipeline.ModelTail = lambda *a, **k: None  # the quantizer then judges variants by the layer's output
    try:
        result["without_tail_s"] = timed_build(args.model, args.calib, args.out / "plain", args.num_samples)
    finally:
        pipeline.ModelTail = real_tail
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
