"""What the build-time weight folds cost in bf16 (README, Gemma 3 and Granite): Gemma's (1 + w) norms, and
Granite's residual_multiplier into o_proj/down_proj and 1 / logits_scaling into the final norm, each folded weight
rounded to bf16 once more.

On tiny random checkpoints (tests/conftest.py's weights, 3 layers, saved in bf16 as published ones are), three
logits are compared over three prompts of ~50 tokens: transformers in float32 on the bf16 weights (the reference);
llmc's bf16 artifact on a CPU (which computes in float32, so its distance is the folds' rounding alone: a Granite
checkpoint with both folded multipliers at 1 shows 0); and transformers' own bf16 forward.

    python -P benchmarks/fold_bf16.py [--out DIR]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # tests.conftest (after the package: the root holds a bare llmc/)
from tests.conftest import TOKENIZER_FILES, hf_encode, make_hf_checkpoint  # noqa: E402

from llmc.compiler.build import build  # noqa: E402
from llmc.compiler.recipe import recipe_from_dict  # noqa: E402
from llmc.runtime.llm import LLM  # noqa: E402

# (family, config overrides): Gemma 3 as the tests' checkpoint (tied, as published), Granite tied and untied
CASES = {
    "Gemma 3, the tests' model": ("gemma3", {}),
    "Granite, published 2B multipliers": ("granite", dict(embedding_multiplier=12.0, attention_multiplier=0.015625,
                                                          residual_multiplier=0.22, logits_scaling=8.0)),
    "Granite, the tests' multipliers": ("granite", dict(embedding_multiplier=12.0, attention_multiplier=0.05,
                                                        residual_multiplier=0.3, logits_scaling=5.0)),
    "Granite, no fold (residual, logits 1)": ("granite", dict(embedding_multiplier=12.0, attention_multiplier=0.015625,
                                                              residual_multiplier=1.0, logits_scaling=1.0)),
}
PROMPTS = ["What light through yonder window breaks? It is the east", "ROMEO:", "In the beginning God created"]


def measure(root: Path, family: str, overrides: dict) -> str:
    from transformers import AutoModelForCausalLM

    f32 = make_hf_checkpoint(root / "f32", family, num_hidden_layers=3, **overrides)
    bf16 = root / "bf16"
    AutoModelForCausalLM.from_pretrained(str(f32), dtype=torch.bfloat16).save_pretrained(bf16)
    for name in TOKENIZER_FILES:
        shutil.copyfile(f32 / name, bf16 / name)
    artifact = root / "artifact"
    build(recipe_from_dict({"model": str(bf16), "output": str(artifact), "dtype": "bfloat16",
                            "runtime": {"max_model_len": 256}}), show_progress=False)
    load = {"attn_implementation": "eager"}
    reference = AutoModelForCausalLM.from_pretrained(str(bf16), dtype=torch.float32, **load).eval()
    theirs = AutoModelForCausalLM.from_pretrained(str(bf16), dtype=torch.bfloat16, **load).eval()
    ours, hf, stds = [], [], []
    with LLM(artifact, device="cpu", max_num_batched_tokens=16) as llm, torch.inference_mode():
        for prompt in PROMPTS:
            ids = hf_encode(f32, prompt) + list(range(200, 240))
            want = reference(torch.tensor([ids])).logits[0].float()
            ours.append((llm.engine.score(ids).float() - want).abs().flatten())
            hf.append((theirs(torch.tensor([ids])).logits[0].float() - want).abs().flatten())
            stds.append(want.std().item())
    ours_d, hf_d = torch.cat(ours), torch.cat(hf)
    return (f"logits std {sum(stds) / len(stds):.3f}; llmc bf16 mean {ours_d.mean():.4f} max {ours_d.max():.4f}; "
            f"transformers bf16 mean {hf_d.mean():.4f} max {hf_d.max():.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/fold_bf16"))
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    for i, (name, (family, overrides)) in enumerate(CASES.items()):
        ties = (True,) if family == "gemma3" else (False, True)
        for tied in ties:
            result = measure(args.out / f"{i}{tied}", family, {**overrides, "tie_word_embeddings": tied})
            print(f"{name}, {'tied' if tied else 'untied'}: {result}", flush=True)


if __name__ == "__main__":
    main()
