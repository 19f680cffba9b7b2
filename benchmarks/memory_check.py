"""The memory plan on a GPU: `llmc inspect`'s estimate for this GPU beside what the runtime measures.

    python benchmarks/memory_check.py [--artifact DIR | --model checkpoints/ref-llama-12m --dtype bfloat16]
        [--gpu-memory-utilization 0.9] [--max-model-len N] [--max-num-seqs N] [--max-num-batched-tokens N]
        [--enforce-eager] [--json out.json]

Without --artifact the checkpoint is built (unquantized, --dtype) into a temporary directory. The
engine starts with the artifact's runtime defaults and the flags given; `llmc inspect` is asked the
same, for this GPU's size. Printed side by side, in MiB: total, usable (× gpu_memory_utilization),
weights, other (outside torch's allocator: CUDA context, kernel modules), activation peak (the
runtime's profiling forward at max_num_batched_tokens), CUDA graphs (the allowance both hold back,
and what capture measured), KV cache bytes and blocks; then the KV difference relative to the
measured KV (the issue's target: within 10%), and the device's memory in use after one full step.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
ROWS = ["total_bytes", "usable_bytes", "weight_bytes", "other_bytes", "activation_bytes", "graph_bytes", "kv_bytes"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default=None, help="an artifact directory (default: build --model)")
    parser.add_argument("--model", default=str(REPO_ROOT / "checkpoints" / "ref-llama-12m"), help="HF checkpoint directory")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--json", default=None, help="also write the results here")
    return parser.parse_args(argv)


def overrides(args: argparse.Namespace) -> dict:
    names = ["gpu_memory_utilization", "max_model_len", "max_num_seqs", "max_num_batched_tokens"]
    chosen = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    return chosen | ({"enforce_eager": True} if args.enforce_eager else {})


def build_artifact(model: str, dtype: str, directory: Path) -> Path:
    from llmc.compiler.build import build
    from llmc.compiler.recipe import recipe_from_dict

    return build(recipe_from_dict({"model": model, "output": str(directory / "artifact"), "dtype": dtype}),
                 show_progress=False).output


def inspect_estimate(artifact: Path, options, total_bytes: int) -> dict:
    """`llmc inspect ARTIFACT --gpu-memory-gib <this GPU>` for the options the engine runs with."""
    import dataclasses

    from llmc.cli_report import inspect_report
    from llmc.runtime import artifact as art
    from llmc.runtime import memory

    manifest = dataclasses.replace(art.read_manifest(artifact), runtime=options)
    return inspect_report(str(artifact), manifest, total_bytes / memory.GIB)["memory_estimate"]


def full_step_in_use(llm, vocab_size: int) -> int:
    """Bytes in use on the device after a step of max_num_batched_tokens prompt tokens and decodes."""
    import random

    import torch

    from llmc.runtime.sampling_params import SamplingParams

    options = llm.engine.options
    length = min(options.max_model_len - 2, options.max_num_batched_tokens)
    rng = random.Random(0)
    count = max(1, min(options.max_num_seqs, options.max_num_batched_tokens // length))
    prompts = [[rng.randrange(10, vocab_size) for _ in range(length)] for _ in range(count)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from llmc.runtime.llm import LLM

    with tempfile.TemporaryDirectory(prefix="memory-check-") as tmp:
        artifact = Path(args.artifact) if args.artifact else build_artifact(args.model, args.dtype, Path(tmp))
        llm = LLM(artifact, device="cuda", disable_log_stats=True, **overrides(args))
        runner = llm.engine.runner
        if runner.memory_plan is None:
            print("the runtime measured no plan: num_kv_blocks is set, or the artifact is parallel", file=sys.stderr)
            return 2
        measured = runner.memory_plan.to_dict()
        estimate = inspect_estimate(artifact, llm.engine.options, measured["total_bytes"])
        graphs = runner.graphs
        in_use = full_step_in_use(llm, llm.engine.manifest.model.vocab_size)
    result = {
        "device": torch.cuda.get_device_name(),
        "artifact": str(args.artifact or args.model),
        "options": overrides(args),
        "estimate": estimate,
        "measured": measured,
        "graphs": None if graphs is None else {
            "batch_sizes": graphs.batch_sizes, "capture_seconds": round(graphs.capture_seconds, 2),
            "measured_bytes": graphs.graph_bytes, "pool_bytes": graphs.pool_bytes,
            "allowance_bytes": measured["graph_bytes"],
        },
        "kv_relative_difference": (estimate["kv_bytes"] - measured["kv_bytes"]) / max(1, measured["kv_bytes"]),
        "in_use_after_full_step_bytes": in_use,
    }
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def print_table(result: dict) -> None:
    estimate, measured = result["estimate"], result["measured"]
    print(f"{result['device']}: {result['artifact']} {result['options']}")
    print("MiB | inspect estimate | runtime measured")
    print("--- | --- | ---")
    for key in ROWS:
        print(f"{key.removesuffix('_bytes')} | {estimate[key] / MIB:.1f} | {measured[key] / MIB:.1f}")
    print(f"kv blocks | {estimate['num_kv_blocks']} | {measured['num_kv_blocks']}")
    print(f"sequences of max_model_len | {estimate['max_concurrent_seqs']:.2f} | {measured['max_concurrent_seqs']:.2f}")
    graphs = result["graphs"]
    if graphs is not None:
        print(f"CUDA graphs: {len(graphs['batch_sizes'])} sizes captured in {graphs['capture_seconds']} s, "
              f"{graphs['measured_bytes'] / MIB:.1f} MiB measured (pool {graphs['pool_bytes'] / MIB:.1f}) "
              f"against an allowance of {graphs['allowance_bytes'] / MIB:.1f} MiB")
    print(f"KV difference (estimate - measured) / measured: {result['kv_relative_difference']:+.2%}")
    print(f"in use after a full step: {result['in_use_after_full_step_bytes'] / MIB:.1f} MiB of "
          f"{measured['usable_bytes'] / MIB:.1f} MiB usable")


if __name__ == "__main__":
    sys.exit(main())
