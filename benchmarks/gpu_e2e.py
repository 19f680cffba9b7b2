"""End to end on a GPU: the ref-llama-12m artifact's greedy output on CUDA against the CPU path.

Builds float32 (must match the CPU token for token), bfloat16 and GPTQ-w4 artifacts, generates greedily
on both devices and prints the agreement. Run on the GPU machine:
    python benchmarks/gpu_e2e.py --out /tmp/e2e
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["ROMEO:", "JULIET:", "First Citizen:", "The history of", "KING HENRY:", "In the morning", "She said", "A"]


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    exact = sum(x == y for x, y in zip(a, b))
    prefix = [next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), len(x)) for x, y in zip(a, b)]
    return {"identical": exact, "of": len(a), "mean_common_prefix": sum(prefix) / len(prefix)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--calib", type=Path, default=None)
    args = parser.parse_args()
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    builds = {"float32": {"dtype": "float32"}, "bfloat16": {"dtype": "bfloat16"}}
    if args.calib:
        builds["gptq-w4-g128"] = {"quantization": {"method": "gptq", "bits": 4, "group_size": 128,
                                                   "calibration": {"data": str(args.calib), "num_samples": 32}}}
    results = {}
    for name, extra in builds.items():
        out = args.out / name
        build(recipe_from_dict({"model": str(REPO / "checkpoints" / "ref-llama-12m"), "output": str(out), **extra}),
              show_progress=False)
        outputs = {}
        for device in ("cpu", "cuda"):
            llm = LLM(out, device=device, max_model_len=256, num_kv_blocks=256)
            outputs[device] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        results[name] = agreement(outputs["cpu"], outputs["cuda"])
        print(name, results[name], flush=True)
    results["device"] = torch.cuda.get_device_name()
    (args.out / "gpu_e2e.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
