"""Embedding (or classification) throughput (runner pooling, runtime/pooling.py) against transformers' batched
forward, in one run.

    source benchmarks/gpu_env.sh && python -P benchmarks/bench_embed.py ARTIFACT --checkpoint CKPT \\
        --lengths 32 128 512 --num-prompts 256 --json $OUT/embed.json

For each prompt length L: --num-prompts prompts of L random token ids.
  llmc          `LLM(ARTIFACT, runner="pooling").embed(prompts)` (LAST pooling, normalized), median of --repeats
                after one warm-up call;
  transformers  the checkpoint's `AutoModel` in the artifact's dtype (sdpa attention) on the same prompts, in
                batches of --hf-batch (equal lengths: no padding), the last position's hidden state normalized:
                what sentence-transformers runs for such a model.
--task classify: a classifier's artifact; llmc's `LLM.classify` against AutoModelForSequenceClassification's softmax
(the last position: equal lengths, no padding).
Reported: prompts/s and tokens/s of each, their ratio, and the largest |difference| between the two embeddings
of the first prompt (a check that both computed the same thing).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.bench_spec_draft import release  # noqa: E402
from llmc.runtime.llm import LLM  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact")
    parser.add_argument("--checkpoint", help="the Hugging Face checkpoint it was built from (the transformers row)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--hf-batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default=None)
    parser.add_argument("--option", action="append", default=[], help="KEY=VALUE engine option (JSON value)")
    parser.add_argument("--task", choices=["embed", "classify"], default="embed",
                        help="classify: a classifier's artifact (LLM.classify against AutoModelForSequenceClassification's "
                        "softmax)")
    parser.add_argument("--profile", action="store_true",
                        help="after timing, one more call of each under torch.profiler: the top GPU kernels by time")
    parser.add_argument("--json")
    return parser.parse_args(argv)


def _prompts(vocab: int, length: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(count)]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_seconds(run, repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        run()
        _sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _profile(run, label: str, rows: int = 12) -> None:
    """One call of `run` under torch.profiler: its GPU kernels' total time and the top `rows` by time."""
    from torch.profiler import ProfilerActivity, profile

    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        run()
        _sync()
        wall = time.perf_counter() - start
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time_total for e in events) / 1e3
    print(f"profile {label}: wall {wall * 1e3:.1f} ms, GPU kernels {total:.1f} ms ({100 * total / (wall * 1e3):.0f}% busy)")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:rows]:
        print(f"  {e.device_time_total / 1e3:8.2f} ms  {e.count:5d}x  {e.key[:100]}")


def measure_llmc(args, options: dict) -> tuple[dict, dict]:
    llm = LLM(args.artifact, device=args.device, runner="pooling", disable_log_stats=True, enable_prefix_caching=False,
              **options)
    pool = llm.embed if args.task == "embed" else llm.classify
    values = (lambda o: o.outputs.embedding) if args.task == "embed" else (lambda o: o.outputs.probs)
    vocab = llm.engine.manifest.model.vocab_size
    rows, firsts = {}, {}
    for length in args.lengths:
        prompts = _prompts(vocab, length, args.num_prompts, length)
        inputs = [{"prompt_token_ids": p} for p in prompts]
        seconds = _median_seconds(lambda: pool(inputs), args.repeats)
        firsts[length] = torch.tensor(values(pool(inputs[:1])[0]))
        if args.profile and torch.cuda.is_available():
            _profile(lambda: pool(inputs), f"llmc L={length}")
        rows[length] = {"seconds": seconds, "prompts_per_s": len(prompts) / seconds,
                        "tokens_per_s": len(prompts) * length / seconds}
        print(f"llmc L={length}: {rows[length]['prompts_per_s']:.1f} prompts/s, "
              f"{rows[length]['tokens_per_s']:.0f} tokens/s", flush=True)
    release(llm)
    return rows, firsts


@torch.inference_mode()
def measure_transformers(args, dtype: torch.dtype, vocab: int) -> tuple[dict, dict]:
    from transformers import AutoModel, AutoModelForSequenceClassification

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    kind = AutoModel if args.task == "embed" else AutoModelForSequenceClassification
    model = kind.from_pretrained(args.checkpoint, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    rows, firsts = {}, {}
    for length in args.lengths:
        ids = torch.tensor(_prompts(vocab, length, args.num_prompts, length), device=device)

        def run():
            out = []
            for start in range(0, len(ids), args.hf_batch):
                if args.task == "classify":
                    out.append(model(input_ids=ids[start : start + args.hf_batch]).logits.float().softmax(-1))
                    continue
                hidden = model(input_ids=ids[start : start + args.hf_batch]).last_hidden_state[:, -1]
                out.append(torch.nn.functional.normalize(hidden.float(), dim=-1))
            return torch.cat(out)

        seconds = _median_seconds(run, args.repeats)
        firsts[length] = run()[0].cpu()
        if args.profile and torch.cuda.is_available():
            _profile(run, f"transformers L={length}")
        rows[length] = {"seconds": seconds, "prompts_per_s": len(ids) / seconds, "tokens_per_s": len(ids) * length / seconds}
        print(f"transformers L={length}: {rows[length]['prompts_per_s']:.1f} prompts/s, "
              f"{rows[length]['tokens_per_s']:.0f} tokens/s", flush=True)
    del model
    return rows, firsts


def main(argv=None) -> None:
    args = parse_args(argv)
    options = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.option)}
    llmc_rows, llmc_firsts = measure_llmc(args, options)
    result = {"artifact": args.artifact, "num_prompts": args.num_prompts, "llmc": llmc_rows,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    if args.checkpoint:
        from llmc.runtime.artifact import read_manifest

        model = read_manifest(args.artifact).model
        hf_rows, hf_firsts = measure_transformers(args, getattr(torch, model.dtype), model.vocab_size)
        result["transformers"] = hf_rows
        for length in args.lengths:
            ratio = llmc_rows[length]["tokens_per_s"] / hf_rows[length]["tokens_per_s"]
            diff = (llmc_firsts[length] - hf_firsts[length]).abs().max().item()
            result.setdefault("ratio", {})[length] = ratio
            result.setdefault("max_abs_diff", {})[length] = diff
            print(f"L={length}: llmc / transformers = {ratio:.2f}x, first embedding max |diff| {diff:.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
