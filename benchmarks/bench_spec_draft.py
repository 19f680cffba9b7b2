"""Decode speed with a draft model (runtime/spec_draft.py) or an EAGLE head (runtime/spec_eagle.py) against the
same engine without one, in one run.

    source benchmarks/gpu_env.sh && python -P benchmarks/bench_spec_draft.py TARGET --draft DRAFT \\
        --ks 2 3 4 --batch-sizes 1 8 --json $OUT/spec_draft.json
    python -P benchmarks/bench_spec_draft.py TARGET --method eagle3 --draft HEAD_DIR --ks 1 3

`--method mtp`: no --draft (a GLM-4.5 artifact's own MTP layer, runtime/mtp_head.py).
`--method eagle3` / `eagle`: DRAFT is the head's folder; `--random-head` writes a random EAGLE-3 head with the
target's shapes there first (a 32,000-token draft vocabulary, Llama-3 heads'), for what the mechanism costs where
no trained head exists (random weights: no draft is accepted).

For each batch size B and each setting (no speculation, then a draft with k = each of --ks) one engine is
opened, warmed up, and asked B requests at once: prompts of --prompt-tokens tokens (random ids, or windows of
--prompt-file's tokens), --tokens new tokens each (greedy, ignore_eos). Reported per setting, median of
--repeats runs: ms per decode step of one sequence = (wall - the prefill's wall) / (tokens - 1), where the
prefill's wall is the same requests with max_tokens 1; output tokens/s over the whole run; the acceptance
rate (accepted / proposed drafts) and tokens per verify step. The speed-up is against the no-speculation
setting of the same batch size, measured in the same process.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from llmc.runtime.llm import LLM  # noqa: E402
from llmc.runtime.sampling_params import SamplingParams  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("target")
    parser.add_argument("--draft", help="the draft model's artifact (an EAGLE head's folder; none for mtp)")
    parser.add_argument("--method", default="draft_model", choices=["draft_model", "eagle3", "eagle", "mtp"])
    parser.add_argument("--random-head", action="store_true", help="write a random EAGLE-3 head at --draft first")
    parser.add_argument("--ks", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-file", help="text whose tokens the prompts are cut from (default: random ids)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--option", action="append", default=[], help="KEY=VALUE engine option (JSON value)")
    parser.add_argument("--profile", action="store_true",
                        help="also one run under torch.profiler (GPU busy time) and one under cProfile (host functions)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if (args.draft is None) != (args.method == "mtp"):
        parser.error("--draft is required, except with --method mtp (which reads the target's own MTP layer)")
    if args.random_head and args.method == "mtp":
        parser.error("--random-head writes an EAGLE-3 head; --method mtp has none")
    return args


def make_prompts(llm: LLM, args, batch: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    if args.prompt_file:
        ids = llm.get_tokenizer().encode(Path(args.prompt_file).read_text(), add_special_tokens=False)
        starts = [rng.randrange(0, len(ids) - args.prompt_tokens) for _ in range(batch)]
        return [ids[s : s + args.prompt_tokens] for s in starts]
    vocab = llm.engine.manifest.model.vocab_size
    return [[rng.randrange(100, vocab - 100) for _ in range(args.prompt_tokens)] for _ in range(batch)]


def timed(llm: LLM, prompts: list[list[int]], max_tokens: int, lora_request=None) -> float:
    """Seconds to generate max_tokens greedy tokens for every prompt at once (benchmarks/bench_lora.py passes adapters)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=lora_request)
    return time.perf_counter() - start


def release(llm: LLM) -> None:
    """Close an engine and give its GPU memory back before the next one of the process starts."""
    llm.close()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(args, options: dict, batch: int) -> dict:
    # no prefix cache: the whole run would find the prefill run's prompt blocks cached and skip its prefill
    llm = LLM(args.target, device=args.device, disable_log_stats=True, enable_prefix_caching=False, **options)
    try:
        timed(llm, make_prompts(llm, args, batch, seed=-1), 8)  # warm-up
        stats0 = llm.stats()
        runs = []
        for repeat in range(args.repeats):
            prompts = make_prompts(llm, args, batch, seed=repeat)
            prefill = timed(llm, prompts, 1)
            whole = timed(llm, prompts, args.tokens)
            runs.append({"prefill_s": prefill, "whole_s": whole,
                         "ms_per_step": 1000 * (whole - prefill) / (args.tokens - 1),
                         "tokens_per_s": batch * args.tokens / whole})
        stats = llm.stats()
        profiled = profile(llm, make_prompts(llm, args, batch, seed=0), args.tokens) if args.profile else {}
        proposed = stats["num_spec_proposed"] - stats0["num_spec_proposed"]
        accepted = stats["num_spec_accepted"] - stats0["num_spec_accepted"]
    finally:
        release(llm)
    return {
        "ms_per_token": statistics.median(r["ms_per_step"] for r in runs),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
        "acceptance": accepted / proposed if proposed else None,
        "runs": runs,
        **profiled,
    }


def profile(llm: LLM, prompts: list[list[int]], tokens: int) -> dict:
    """One run under torch.profiler: its wall and the time some CUDA kernel ran (the union of their intervals,
    benchmarks/profile_step.py), so wall - kernel is the time the GPU waited for the host; then one under cProfile:
    the host functions by their own time (the 25 largest, as pstats prints them)."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from benchmarks.profile_step import busy_us, kernel_events

    result = {}
    if torch.cuda.is_available():
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            wall = timed(llm, prompts, tokens)
            torch.cuda.synchronize()
        kernel_ms = busy_us(kernel_events(prof)) / 1000
        result.update(profiled_wall_ms=round(1000 * wall, 2), kernel_ms=round(kernel_ms, 2),
                      gpu_busy=round(kernel_ms / (1000 * wall), 3))
    host = cProfile.Profile()
    host.enable()
    timed(llm, prompts, tokens)
    host.disable()
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(25)
    result["host_top"] = text.getvalue()
    return result


def write_random_eagle3_head(target: str, out: Path, draft_vocab: int = 32000, seed: int = 0) -> None:
    """A random EAGLE-3 head in the published layout (README "Speculative decoding with an EAGLE-3 head") with the
    target's hidden size, heads and vocabulary: benchmarks/train_eagle.py's Head as initialized, in bfloat16."""
    from benchmarks.train_eagle import Head, save_head
    from llmc.runtime import artifact as art

    config = art.read_manifest(Path(target)).model
    torch.manual_seed(seed)
    draft_vocab = min(draft_vocab, config.vocab_size)
    head = Head(config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, config.intermediate_size,
                draft_vocab, config.rms_norm_eps, config.rope_theta)
    draft_ids = torch.randperm(config.vocab_size)[:draft_vocab].sort().values
    save_head(head, draft_ids, config.vocab_size, out, torch.bfloat16,
              max_position_embeddings=config.max_position_embeddings)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.random_head:
        write_random_eagle3_head(args.target, Path(args.draft))
    base_options = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.option)}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    results = {"device": device, "target": args.target, "draft": args.draft, "method": args.method, "rows": []}
    for batch in args.batch_sizes:
        base = None
        for k in [None, *args.ks]:
            options = dict(base_options, max_num_seqs=max(batch, 1))
            if k is not None:
                options["speculative"] = {"method": args.method, "num_speculative_tokens": k,
                                          **({"model": args.draft} if args.draft else {})}
            row = {"batch": batch, "k": k, **measure(args, options, batch)}
            base = base or row
            row["speedup"] = base["ms_per_token"] / row["ms_per_token"]
            results["rows"].append(row)
            acc = "-" if row["acceptance"] is None else f"{row['acceptance']:.3f}"
            busy = f", GPU busy {row['gpu_busy']:.2f} of a profiled run" if "gpu_busy" in row else ""
            print(f"B={batch} k={k}: {row['ms_per_token']:.3f} ms/token, {row['tokens_per_s']:.1f} tokens/s, "
                  f"acceptance {acc}, x{row['speedup']:.2f}{busy}", flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
