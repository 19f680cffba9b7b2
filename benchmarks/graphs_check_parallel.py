"""CUDA graphs of one parallel rank, on ONE GPU: replay == eager, with the all-reduces inside the graph.

    python benchmarks/graphs_check_parallel.py [--artifact DIR | --model checkpoints/ref-llama-12m]
        [--tensor 2] [--dtype bfloat16] [--batch-sizes 1,3,8] [--context 100] [--steps 8] [--json out.json]

Without --artifact the checkpoint is built (unquantized, --dtype, parallel tensor --tensor, target
cuda) into a temporary directory. Rank 0's shard of that tensor-parallel build is loaded by the
runtime's own ShardRunner (runtime/parallel/shard_runner.py), exactly as a parallel engine's rank
loads it, but with a tensor-parallel group of ONE NCCL rank: its all-reduces (embedding, o and down
of every layer) are real NCCL collectives that return their input, so the rank computes its partial
sums, and the shapes, kernels and collectives of a tensor-2 rank are what is captured. The runner
captures its decode graphs (same sizes, order and padding as every rank of an engine). Then, per
batch size B: B sequences of --context random tokens are prefilled eagerly, and --steps decode steps
run twice each, eagerly (ShardRunner.stage_forward) and by replay (CudaGraphs.run), on the same
inputs (both write the same K/V to the same slots). Reported per B:
  max_abs_diff        largest |replay - eager| over the final hidden states of every step
  eager_allreduces    Python-level all-reduce calls per eager step (2 per layer + the embedding)
  replay_allreduces   the same during replays: 0 when the collectives are inside the graph
  eager_ms, replay_ms wall time per step (synchronised)
Exit status 1 if a replay differs from eager by more than --atol (default 0: kernels are the same
and the decode attention splits keys alike in both) or calls an all-reduce from Python, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default=None, help="a tensor-parallel artifact (default: build --model)")
    parser.add_argument("--model", default=str(REPO_ROOT / "checkpoints" / "ref-llama-12m"), help="HF checkpoint directory")
    parser.add_argument("--tensor", type=int, default=2, help="tensor size of the build (rank 0's shard is checked)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--batch-sizes", default="1,3,8", help="decode batch sizes, comma-separated")
    parser.add_argument("--context", type=int, default=100, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=8, help="decode steps compared per batch size")
    parser.add_argument("--atol", type=float, default=0.0)
    parser.add_argument("--json", default=None, help="also write the results here")
    return parser.parse_args(argv)


def load_rank0(artifact: Path, max_num_seqs: int, device_type: str = "cuda"):
    """Rank 0's ShardRunner, with a one-rank NCCL tensor group (gloo on a CPU, where nothing is
    captured: for trying this script's set-up), and its all-reduce call counter."""
    import datetime

    import torch
    import torch.distributed as dist

    from llmc.runtime import artifact as art
    from llmc.runtime.options import resolve_options
    from llmc.runtime.parallel.groups import ParallelGroups, Rendezvous, TensorParallelGroup, _nccl
    from llmc.runtime.parallel.layout import rank_layout
    from llmc.runtime.parallel.shard_runner import ShardRunner

    manifest = art.read_manifest(artifact)
    options = resolve_options(manifest, {"max_num_seqs": max_num_seqs, "gpu_memory_utilization": 0.5})
    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    store = Rendezvous("127.0.0.1", 0, 1).connect(0, datetime.timedelta(seconds=60))
    groups = ParallelGroups(store, 0, 1, 1, device)  # control and device groups of one rank
    prefixed = dist.PrefixStore("llmc/", store)
    backend = (_nccl(prefixed, "tp-check/", 0, 1) if device.type == "cuda"
               else dist.ProcessGroupGloo(dist.PrefixStore("tp-check/", prefixed), 0, 1, datetime.timedelta(seconds=60)))
    groups.tp = TensorParallelGroup(backend, 1)
    calls = [0]
    inner = groups.tp.all_reduce

    def counted(tensor):
        calls[0] += 1
        return inner(tensor)

    groups.tp.all_reduce = counted  # the layers call the group object: this instance attribute wins
    layout = rank_layout(manifest.model, manifest.parallel, 0)
    shard = ShardRunner(artifact, manifest, options, device, layout, groups)
    return shard, options, calls, groups


def sequences_batch(batch_size: int, lengths: list[int], num_new: int, block_size: int, device):
    """ForwardBatch of batch_size sequences (sequence i in blocks [i * per_seq, ...)), each computing
    its last num_new tokens of lengths[i]."""
    import torch

    from llmc.runtime.forward_batch import ForwardBatch

    per_seq = -(-max(lengths) // block_size) + 1
    tables = torch.arange(batch_size * per_seq, dtype=torch.int32).view(batch_size, per_seq)
    positions = torch.cat([torch.arange(n - num_new, n) for n in lengths])
    seq = torch.repeat_interleave(torch.arange(batch_size), num_new)
    slots = tables[seq, positions // block_size].long() * block_size + positions % block_size
    ends = torch.arange(1, batch_size + 1) * num_new - 1
    return ForwardBatch(positions=positions.to(device), slot_mapping=slots.to(device), block_tables=tables.to(device),
                        context_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
                        query_lens=[num_new] * batch_size, max_context_len=max(lengths),
                        logits_indices=ends.to(device))


def check_batch(shard, options, calls, batch_size: int, args: argparse.Namespace, vocab_size: int) -> dict:
    import torch

    with torch.inference_mode():
        return _check_batch(shard, options, calls, batch_size, args, vocab_size)


def _check_batch(shard, options, calls, batch_size: int, args: argparse.Namespace, vocab_size: int) -> dict:
    import torch

    gen = torch.Generator().manual_seed(batch_size)
    device, block_size = shard.device, options.block_size
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    prompt = torch.randint(10, vocab_size, (batch_size * args.context,), generator=gen).to(device)
    shard.stage_forward(prompt, sequences_batch(batch_size, [args.context] * batch_size, args.context, block_size, device))
    diff, timings, counts = 0.0, {"eager": 0.0, "replay": 0.0}, {"eager": 0, "replay": 0}
    for step in range(args.steps):
        lengths = [args.context + step + 1] * batch_size
        batch = sequences_batch(batch_size, lengths, 1, block_size, device)
        ids = torch.randint(10, vocab_size, (batch_size,), generator=gen).to(device)
        assert shard.graphs.can_run(batch)
        outs = {}
        for mode, run in (("eager", shard.stage_forward), ("replay", shard.graphs.run)):
            sync()
            before, start = calls[0], time.perf_counter()
            outs[mode] = run(ids, batch)[:batch_size].float().clone()
            sync()
            timings[mode] += time.perf_counter() - start
            counts[mode] += calls[0] - before
        diff = max(diff, (outs["replay"] - outs["eager"]).abs().max().item())
    return {"batch_size": batch_size, "max_abs_diff": diff, "eager_allreduces": counts["eager"] / args.steps,
            "replay_allreduces": counts["replay"] / args.steps,
            "eager_ms": round(1000 * timings["eager"] / args.steps, 3),
            "replay_ms": round(1000 * timings["replay"] / args.steps, 3)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from llmc.compiler.build import build
    from llmc.compiler.recipe import recipe_from_dict

    sizes = [int(b) for b in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="graphs-check-parallel-") as tmp:
        artifact = Path(args.artifact) if args.artifact else build(recipe_from_dict({
            "model": args.model, "output": str(Path(tmp) / "artifact"), "dtype": args.dtype,
            "parallel": {"tensor": args.tensor}, "target": {"device": "cuda"},
            "runtime": {"max_model_len": args.context + args.steps + 16, "max_num_seqs": max(sizes)}}),
            show_progress=False).output
        shard, options, calls, groups = load_rank0(artifact, max(sizes))
        vocab_size = shard.layout.vocab_size * shard.layout.tp_size
        tp_backend = type(groups.tp.backend).__name__
        try:
            rows = [check_batch(shard, options, calls, b, args, vocab_size) for b in sizes]
        finally:
            groups.tp.backend.shutdown()
            groups.shutdown()
    print("batch_size | max_abs_diff | eager all-reduces/step | replay all-reduces/step | eager ms | replay ms")
    print("--- | --- | --- | --- | --- | ---")
    for row in rows:
        print(" | ".join(str(v) for v in row.values()))
    info = {"batch_sizes": shard.graphs.batch_sizes, "capture_seconds": round(shard.graphs.capture_seconds, 2),
            "graph_bytes": shard.graphs.graph_bytes, "tp_backend": tp_backend}
    print(f"rank 0 of tensor {shard.layout.tp_size}: graphs {info['batch_sizes']} captured in {info['capture_seconds']} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "args": vars(args),
                                               "results": rows, "graphs": info}, indent=2) + "\n")
    return 0 if all(row["max_abs_diff"] <= args.atol and row["replay_allreduces"] == 0 for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
