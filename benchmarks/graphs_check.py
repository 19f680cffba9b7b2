"""CUDA graphs on a GPU: decode latency with and without them, and that greedy outputs are identical.

    python benchmarks/graphs_check.py [--artifact DIR | --model checkpoints/ref-llama-12m --dtype bfloat16]
        [--batch-sizes 1,3,8,32] [--prompt-tokens 128] [--output-tokens 128] [--repeats 3] [--json out.json]

Without --artifact the checkpoint is built (unquantized, --dtype) into a temporary directory. The
engine runs once with enforce_eager and once with graphs (one after the other, each with
--gpu-memory-utilization), on the same prompts: B prompts of --prompt-tokens random token ids, each
generating exactly --output-tokens tokens, greedy, eos ignored. Reported per batch size B:
  decode_ms     (wall(max_tokens=N) - wall(max_tokens=1)) / (N - 1): one decode step of the batch
  speedup       eager decode_ms / graphs decode_ms
  identical     prompts whose greedy tokens are the same with and without graphs (a B that is not a
                captured size pads to the next one, where a GEMM of more rows may round differently)
and the capture time and graph memory of the graphs engine.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default=None, help="an artifact directory (default: build --model)")
    parser.add_argument("--model", default=str(REPO_ROOT / "checkpoints" / "ref-llama-12m"), help="HF checkpoint directory")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--batch-sizes", default="1,3,8,32", help="concurrent sequences, comma-separated")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per point (the best is kept)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="per engine")
    parser.add_argument("--json", default=None, help="also write the results here")
    return parser.parse_args(argv)


def build_artifact(model: str, dtype: str, max_model_len: int, directory: Path) -> Path:
    from llmc.compiler.build import build
    from llmc.compiler.recipe import recipe_from_dict

    recipe = {"model": model, "output": str(directory / "artifact"), "dtype": dtype,
              "runtime": {"max_model_len": max_model_len, "max_num_seqs": 64}}
    return build(recipe_from_dict(recipe), show_progress=False).output


def measure(llm, prompts: list[list[int]], output_tokens: int, repeats: int) -> tuple[float, list[list[int]]]:
    """(decode ms per step, the greedy tokens of each prompt)."""
    from llmc.runtime.sampling_params import SamplingParams

    def run(max_tokens: int) -> tuple[float, list]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        return time.perf_counter() - start, [o.outputs[0].token_ids for o in outputs]

    run(4)  # warm-up: allocator, cuBLAS
    prefill = min(run(1)[0] for _ in range(repeats))
    timed = [run(output_tokens) for _ in range(repeats)]
    full = min(t for t, _ in timed)
    return 1000 * (full - prefill) / (output_tokens - 1), timed[0][1]


def run_mode(artifact: Path, enforce_eager: bool, batches: dict[int, list], args: argparse.Namespace) -> dict:
    import torch

    from llmc.runtime.llm import LLM

    llm = LLM(artifact, device="cuda", enforce_eager=enforce_eager, disable_log_stats=True,
              gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=max(batches))
    result = {"decode_ms": {}, "tokens": {}}
    for batch_size, prompts in batches.items():
        result["decode_ms"][batch_size], result["tokens"][batch_size] = measure(
            llm, prompts, args.output_tokens, args.repeats)
        print(f"{'eager' if enforce_eager else 'graphs'} B={batch_size}: {result['decode_ms'][batch_size]:.3f} ms/step",
              file=sys.stderr, flush=True)
    graphs = llm.engine.runner.graphs
    if graphs is not None:
        result["graphs"] = {"batch_sizes": graphs.batch_sizes, "capture_seconds": round(graphs.capture_seconds, 2),
                            "graph_bytes": graphs.graph_bytes, "pool_bytes": graphs.pool_bytes,
                            "num_replays": graphs.num_replays}
    del llm, graphs
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from llmc.runtime import artifact as art

    with tempfile.TemporaryDirectory(prefix="graphs-check-") as tmp:
        max_model_len = args.prompt_tokens + args.output_tokens + 8
        artifact = (Path(args.artifact) if args.artifact
                    else build_artifact(args.model, args.dtype, max_model_len, Path(tmp)))
        vocab_size = art.read_manifest(artifact).model.vocab_size
        rng = random.Random(0)
        batches = {b: [[rng.randrange(10, vocab_size) for _ in range(args.prompt_tokens)] for _ in range(b)]
                   for b in (int(b) for b in args.batch_sizes.split(","))}
        eager, graphs = run_mode(artifact, True, batches, args), run_mode(artifact, False, batches, args)
    rows = []
    for batch_size in batches:
        same = sum(a == b for a, b in zip(eager["tokens"][batch_size], graphs["tokens"][batch_size]))
        rows.append({"batch_size": batch_size, "eager_decode_ms": round(eager["decode_ms"][batch_size], 3),
                     "graphs_decode_ms": round(graphs["decode_ms"][batch_size], 3),
                     "speedup": round(eager["decode_ms"][batch_size] / graphs["decode_ms"][batch_size], 2),
                     "identical": f"{same}/{batch_size}"})
    print("batch_size | eager ms/step | graphs ms/step | speedup | identical greedy outputs")
    print("--- | --- | --- | --- | ---")
    for row in rows:
        print(" | ".join(str(v) for v in row.values()))
    info = graphs.get("graphs", {})
    print(f"graphs: {info.get('batch_sizes')} captured in {info.get('capture_seconds')} s, "
          f"{info.get('graph_bytes', 0) / 2**20:.1f} MiB, {info.get('num_replays')} replays")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "args": vars(args),
                                               "results": rows, "graphs": info}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
