"""How far a bf16 artifact's logits on CUDA are from the same artifact's on the CPU, per family and weight
kind: the per-position cosine (min / mean) and argmax agreement over one 50-token sequence. A diagnostic for
GPU tests that compare the two paths (session 37: Gemma 3's quantized bf16 builds): it says how far apart
the paths are for a family whose kernels are not in question (Llama) next to the one being checked.

    python benchmarks/gpu_cpu_agreement.py --out DIR [--families llama gemma3]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # tests.conftest (after the package: the repo root holds a bare llmc/)

KINDS = {"dense": {"method": "none"}, "w4a16": {"method": "rtn", "bits": 4, "group_size": 32}, "fp8": {"method": "fp8"}}


def main() -> None:
    from llmc.compiler.build import build
    from llmc.compiler.recipe import recipe_from_dict
    from llmc.runtime.llm import LLM
    from tests.conftest import hf_encode, make_hf_checkpoint

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--families", nargs="+", default=["llama", "gemma3"])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            checkpoint = make_hf_checkpoint(Path(tmp) / family, family)
            token_ids = hf_encode(checkpoint, "What light through yonder window breaks? It is the east") + list(range(100, 140))
            for kind, quantization in KINDS.items():
                for dtype in ("float32", "bfloat16"):
                    out = Path(tmp) / f"{family}-{kind}-{dtype}"
                    build(recipe_from_dict({"model": str(checkpoint), "output": str(out), "dtype": dtype,
                                            "runtime": {"max_model_len": 256}, "quantization": quantization}),
                          show_progress=False)
                    cpu = LLM(out, device="cpu").engine.score(token_ids).float()
                    llm = LLM(out, device="cuda", gpu_memory_utilization=0.3)
                    gpu = llm.engine.score(token_ids).float().cpu()
                    llm.close()
                    cosine = torch.nn.functional.cosine_similarity(gpu, cpu, dim=-1)
                    row = {"family": family, "kind": kind, "dtype": dtype, "cos_min": round(cosine.min().item(), 4),
                           "cos_mean": round(cosine.mean().item(), 4),
                           "argmax_agree": round((gpu.argmax(-1) == cpu.argmax(-1)).float().mean().item(), 3),
                           "max_abs": round((gpu - cpu).abs().max().item(), 4), "logit_std": round(cpu.std().item(), 3)}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    Path(args.out, "gpu_cpu_agreement.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
