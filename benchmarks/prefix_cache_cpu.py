"""Prefix caching on a CPU: many users sharing one system prompt, caching on vs off.

    python benchmarks/prefix_cache_cpu.py [--artifact DIR] [--num-users 48] [--json out.json]

Every user sends the same system prompt (the first `--system-tokens` tokens of the embedded
checkpoint's README) followed by a distinct question, all at once; generation is greedy and
short, so the run is dominated by prefill. Without `--artifact`, the embedded ref-llama-12m is
built from recipes/ref-llama-12m.yaml into a temporary directory first.

Reports, for caching on and off: the scheduler's prefix-cache queries and hits (tokens), the hit
rate, the prefill tokens actually computed (prompt tokens minus tokens served from the cache,
from each RequestOutput), the wall time of `generate`, and the off/on ratios; checks that the
greedy outputs are identical. Exits 1 if they are not.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import yaml

from llmc.runtime import artifact as art
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.tokenizer import load_tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
RECIPE = REPO_ROOT / "recipes" / "ref-llama-12m.yaml"
SYSTEM_TEXT = REPO_ROOT / "checkpoints" / "ref-llama-12m" / "README.md"
TOPICS = ("the river", "a king", "the harvest", "old books", "the sea", "a letter", "winter",
          "the school", "a horse", "the market", "friendship", "the law")
ASKS = ("What do you know about", "Tell me a story about", "Write two lines on",
        "Why should I care about")


def build_reference_artifact(directory: Path) -> Path:
    """Build the embedded checkpoint with the shipped recipe into `directory`/artifact."""
    from llmc.compiler.build import build
    from llmc.compiler.recipe import recipe_from_dict

    data = yaml.safe_load(RECIPE.read_text())
    data["model"] = str(REPO_ROOT / data["model"])
    data["output"] = str(directory / "artifact")
    return build(recipe_from_dict(data, source=str(RECIPE)), show_progress=False).output


def make_prompts(tokenizer, num_users: int,
                 num_system_tokens: int) -> tuple[list[int], list[list[int]]]:
    """The shared system prompt's ids, and per user: it, then a question no one else asks."""
    system_ids = tokenizer.encode(SYSTEM_TEXT.read_text())[:num_system_tokens]
    prompts = []
    for user in range(num_users):
        ask, topic = ASKS[user % len(ASKS)], TOPICS[(user // len(ASKS)) % len(TOPICS)]
        question = f"\n\nUser {user}: {ask} {topic}?\nAnswer:"
        prompts.append(system_ids + tokenizer.encode(question, add_special_tokens=False))
    return system_ids, prompts


def run_mode(artifact: Path, prompts: list[list[int]], max_tokens: int,
             enable_prefix_caching: bool) -> dict:
    """Serve all prompts at once with caching on or off; the measurements of that run."""
    llm = LLM(artifact, device="cpu", enable_prefix_caching=enable_prefix_caching)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([[7, 8, 9]], params)  # warm-up: first-call overheads stay out of the timing
    before = llm.stats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall_s = time.perf_counter() - start
    after = llm.stats()
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    num_prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    num_cached_tokens = sum(o.num_cached_tokens for o in outputs)
    return {
        "prefix_caching": enable_prefix_caching,
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "hit_rate": hits / queries if queries else 0.0,
        "prompt_tokens": num_prompt_tokens,
        "prefill_tokens_computed": num_prompt_tokens - num_cached_tokens,
        "wall_s": wall_s,
        "output_token_ids": [o.outputs[0].token_ids for o in outputs],
    }


def print_table(on: dict, off: dict, report: dict) -> None:
    rows = [("prefix_cache_queries", "{:d}"), ("prefix_cache_hits", "{:d}"),
            ("hit_rate", "{:.1%}"), ("prompt_tokens", "{:d}"),
            ("prefill_tokens_computed", "{:d}"), ("wall_s", "{:.2f}")]
    print(f"{report['num_users']} users, system prompt {report['system_tokens']} tokens, "
          f"{report['max_tokens']} greedy tokens each")
    print(f"{'':26}{'caching off':>14}{'caching on':>14}")
    for name, fmt in rows:
        print(f"{name:26}{fmt.format(off[name]):>14}{fmt.format(on[name]):>14}")
    print(f"prefill tokens computed, off/on: {report['prefill_speedup']:.2f}x")
    print(f"wall time, off/on:               {report['wall_speedup']:.2f}x")
    print(f"greedy outputs identical:        {'yes' if report['outputs_identical'] else 'NO'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=Path, help="artifact directory (default: build one)")
    parser.add_argument("--num-users", type=int, default=48)
    parser.add_argument("--system-tokens", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    logging.getLogger("llmc").setLevel(logging.WARNING)
    with ExitStack() as stack:
        artifact = args.artifact
        if artifact is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="llmc-bench-")))
            artifact = build_reference_artifact(workdir)
        tokenizer = load_tokenizer(artifact / art.TOKENIZER_DIR)
        system_ids, prompts = make_prompts(tokenizer, args.num_users, args.system_tokens)
        off = run_mode(artifact, prompts, args.max_tokens, enable_prefix_caching=False)
        on = run_mode(artifact, prompts, args.max_tokens, enable_prefix_caching=True)
    report = {
        "num_users": args.num_users,
        "system_tokens": len(system_ids),
        "max_tokens": args.max_tokens,
        "prefill_speedup": off["prefill_tokens_computed"] / on["prefill_tokens_computed"],
        "wall_speedup": off["wall_s"] / on["wall_s"],
        "outputs_identical": on["output_token_ids"] == off["output_token_ids"],
    }
    print_table(on, off, report)
    if args.json is not None:
        results = {name: {k: v for k, v in mode.items() if k != "output_token_ids"}
                   for name, mode in (("caching_on", on), ("caching_off", off))}
        args.json.write_text(json.dumps({**report, **results}, indent=2) + "\n")
    return 0 if report["outputs_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
