"""Embedding (or classification) throughput (runner pooling, runtime/pooling.py) against transformers' batched
forward, in one run.

    source benchmarks/gpu_env.sh && python -P benchmarks/bench_embed.py ARTIFACT [ARTIFACT ...] --checkpoint CKPT \\
        --lengths 32 128 512 --num-prompts 256 --json $OUT/embed.json

For each prompt length L: --num-prompts prompts of L random token ids.
  llmc          `LLM(ARTIFACT, runner="pooling").embed(prompts)` (LAST pooling, normalized), median of --repeats
                after one warm-up call;
  transformers  the checkpoint's `AutoModel` in the artifact's dtype (sdpa attention) on the same prompts, in
                batches of --hf-batch (equal lengths: no padding), the last position's hidden state normalized:
                what sentence-transformers runs for such a model.
--task classify: a classifier's artifact; llmc's `LLM.classify` against AutoModelForSequenceClassification's softmax
(the last position: equal lengths, no padding).
Several ARTIFACTs (e.g. a torch build and an onnx-cpu build of one checkpoint) are measured in turn, one engine at a
time. Reported: prompts/s and tokens/s of each, each artifact's ratio to transformers, and the largest |difference|
between its output for the first prompt and transformers' (a check that both computed the same thing). The JSON
keys llmc's rows, ratios and differences by artifact path.

--interleave loads every engine and the transformers model at once and times them in turn within each repeat
(after one warm-up round), so that a shared machine's slow spells fall on all of them alike; without it each
engine is measured whole, then released, before the next starts (what a GPU with room for one engine needs).
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
    parser.add_argument("artifacts", nargs="+", metavar="artifact")
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
    parser.add_argument("--interleave", action="store_true", help="all engines loaded, timed in turn per repeat")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if args.interleave and args.profile:
        parser.error("--profile profiles each engine alone; drop --interleave")
    return args


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


def _row(seconds: float, num_prompts: int, length: int) -> dict:
    return {"seconds": seconds, "prompts_per_s": num_prompts / seconds, "tokens_per_s": num_prompts * length / seconds}


def _llmc(args, artifact: str, options: dict):
    """(the engine, its pooling call, what an output's values are)."""
    llm = LLM(artifact, device=args.device, runner="pooling", disable_log_stats=True, enable_prefix_caching=False,
              **options)
    pool = llm.embed if args.task == "embed" else llm.classify
    values = (lambda o: o.outputs.embedding) if args.task == "embed" else (lambda o: o.outputs.probs)
    return llm, pool, values


def _hf_model(args, dtype: torch.dtype):
    from transformers import AutoModel, AutoModelForSequenceClassification

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    kind = AutoModel if args.task == "embed" else AutoModelForSequenceClassification
    return kind.from_pretrained(args.checkpoint, dtype=dtype, attn_implementation="sdpa").to(device).eval(), device


def _hf_run(args, model, ids: torch.Tensor) -> torch.Tensor:
    """transformers' outputs for `ids` [num_prompts, length]: the last position's hidden state normalized, or the
    classifier's softmax."""
    out = []
    for start in range(0, len(ids), args.hf_batch):
        if args.task == "classify":
            out.append(model(input_ids=ids[start : start + args.hf_batch]).logits.float().softmax(-1))
            continue
        hidden = model(input_ids=ids[start : start + args.hf_batch]).last_hidden_state[:, -1]
        out.append(torch.nn.functional.normalize(hidden.float(), dim=-1))
    return torch.cat(out)


@torch.inference_mode()
def measure_interleaved(args, options: dict, dtype: torch.dtype, vocab: int) -> tuple[dict, dict, dict, dict]:
    """--interleave: (llmc rows and first outputs by artifact, transformers' rows and first outputs: empty without
    --checkpoint)."""
    engines = {artifact: _llmc(args, artifact, options) for artifact in args.artifacts}
    model, device = _hf_model(args, dtype) if args.checkpoint else (None, None)
    names = [*args.artifacts, *(["transformers"] if model is not None else [])]
    rows, firsts = {name: {} for name in names}, {name: {} for name in names}
    for length in args.lengths:
        prompts = _prompts(vocab, length, args.num_prompts, length)
        inputs = [{"prompt_token_ids": p} for p in prompts]
        runs = {artifact: (lambda pool=pool: pool(inputs)) for artifact, (_, pool, _) in engines.items()}
        if model is not None:
            ids = torch.tensor(prompts, device=device)
            runs["transformers"] = lambda: _hf_run(args, model, ids)
        times = {name: [] for name in names}
        for repeat in range(args.repeats + 1):  # round 0 warms up
            for name, run in runs.items():
                _sync()
                start = time.perf_counter()
                run()
                _sync()
                if repeat:
                    times[name].append(time.perf_counter() - start)
        for name in names:
            rows[name][length] = _row(statistics.median(times[name]), len(prompts), length)
            if name in engines:
                _, pool, values = engines[name]
                firsts[name][length] = torch.tensor(values(pool(inputs[:1])[0]))
            else:
                firsts[name][length] = runs[name]()[0].cpu()
            print(f"{name} L={length}: {rows[name][length]['prompts_per_s']:.1f} prompts/s, "
                  f"{rows[name][length]['tokens_per_s']:.0f} tokens/s (median of {args.repeats}, interleaved)", flush=True)
    for llm, _, _ in engines.values():
        release(llm)
    hf_rows, hf_firsts = rows.pop("transformers", {}), firsts.pop("transformers", {})
    return rows, firsts, hf_rows, hf_firsts


def measure_llmc(args, artifact: str, options: dict) -> tuple[dict, dict]:
    llm, pool, values = _llmc(args, artifact, options)
    vocab = llm.engine.manifest.model.vocab_size
    rows, firsts = {}, {}
    for length in args.lengths:
        prompts = _prompts(vocab, length, args.num_prompts, length)
        inputs = [{"prompt_token_ids": p} for p in prompts]
        seconds = _median_seconds(lambda: pool(inputs), args.repeats)
        firsts[length] = torch.tensor(values(pool(inputs[:1])[0]))
        if args.profile and torch.cuda.is_available():
            _profile(lambda: pool(inputs), f"llmc L={length}")
        rows[length] = _row(seconds, len(prompts), length)
        print(f"llmc {artifact} L={length}: {rows[length]['prompts_per_s']:.1f} prompts/s, "
              f"{rows[length]['tokens_per_s']:.0f} tokens/s", flush=True)
    release(llm)
    return rows, firsts


@torch.inference_mode()
def measure_transformers(args, dtype: torch.dtype, vocab: int) -> tuple[dict, dict]:
    model, device = _hf_model(args, dtype)
    rows, firsts = {}, {}
    for length in args.lengths:
        ids = torch.tensor(_prompts(vocab, length, args.num_prompts, length), device=device)
        run = lambda: _hf_run(args, model, ids)  # noqa: E731
        seconds = _median_seconds(run, args.repeats)
        firsts[length] = run()[0].cpu()
        if args.profile and torch.cuda.is_available():
            _profile(run, f"transformers L={length}")
        rows[length] = _row(seconds, len(ids), length)
        print(f"transformers L={length}: {rows[length]['prompts_per_s']:.1f} prompts/s, "
              f"{rows[length]['tokens_per_s']:.0f} tokens/s", flush=True)
    del model
    return rows, firsts


def main(argv=None) -> None:
    args = parse_args(argv)
    options = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.option)}
    from llmc.runtime.artifact import read_manifest

    model = read_manifest(args.artifacts[0]).model
    if args.interleave:
        rows, firsts, hf_rows, hf_firsts = measure_interleaved(args, options, getattr(torch, model.dtype),
                                                               model.vocab_size)
        measured = {artifact: (rows[artifact], firsts[artifact]) for artifact in args.artifacts}
    else:
        measured = {artifact: measure_llmc(args, artifact, options) for artifact in args.artifacts}
    result = {"artifacts": args.artifacts, "num_prompts": args.num_prompts, "interleave": args.interleave,
              "llmc": {artifact: rows for artifact, (rows, _) in measured.items()},
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    if args.checkpoint:
        if not args.interleave:
            hf_rows, hf_firsts = measure_transformers(args, getattr(torch, model.dtype), model.vocab_size)
        result["transformers"] = hf_rows
        for artifact, (llmc_rows, llmc_firsts) in measured.items():
            for length in args.lengths:
                ratio = llmc_rows[length]["tokens_per_s"] / hf_rows[length]["tokens_per_s"]
                diff = (llmc_firsts[length] - hf_firsts[length]).abs().max().item()
                result.setdefault("ratio", {}).setdefault(artifact, {})[length] = ratio
                result.setdefault("max_abs_diff", {}).setdefault(artifact, {})[length] = diff
                print(f"{artifact} L={length}: llmc / transformers = {ratio:.2f}x, first output max |diff| {diff:.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
