"""What giving a prompt as embeddings (enable_prompt_embeds) costs against giving its token ids, on one artifact in one
process: the rows are the artifact's own embedding rows of the same ids, so both forms compute the same model.

Two measures, each form alternating per round (median of --repeats):
- time to first token of one request into an idle engine (a prompt of --ttft-len tokens, max_tokens 1);
- output tokens/s of --num-prompts requests of --len prompt tokens and --max-tokens output tokens each.

A prompt given as embeddings prefills through the piecewise graphs' row buffers (runtime/piecewise_graphs.py NOTE
(rows); eagerly before session 42's change); decode steps replay their graphs either way.

    python -P benchmarks/bench_prompt_embeds.py ARTIFACT [--device cuda] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact")
    parser.add_argument("--device", default=None)
    parser.add_argument("--ttft-len", type=int, nargs="+", default=[16, 128, 512])
    parser.add_argument("--len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--option", action="append", default=[], help="engine option KEY=VALUE (JSON value)")
    parser.add_argument("--profile", action="store_true", help="cProfile one embeddings request of each --ttft-len "
                                                                   "after its measures (the top 25 by cumulative time)")
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


def _prompts(llm: LLM, num: int, length: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(token-id prompts, the same prompts as their embedding rows)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = llm.engine.manifest.model.vocab_size
    table = llm.engine.runner.model.embed.weight
    ids = [torch.randint(100, vocab - 100, (length,), generator=generator) for _ in range(num)]
    return ([{"prompt_token_ids": i.tolist()} for i in ids],
            [{"prompt_embeds": table[i.to(table.device)].float().cpu()} for i in ids])


def _timed(llm: LLM, prompts: list[dict], params: SamplingParams) -> tuple[float, list]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return time.perf_counter() - start, outputs


def main(argv=None) -> None:
    args = parse_args(argv)
    options = {key: json.loads(value) for key, value in (o.split("=", 1) for o in args.option)}
    llm = LLM(args.artifact, device=args.device, enable_prompt_embeds=True, **options)
    result = {"ttft_ms": {}, "throughput": {}}
    first = SamplingParams(temperature=0, max_tokens=1)
    for length in args.ttft_len:
        ids, embeds = _prompts(llm, args.repeats + 1, length, seed=length)
        times = {"ids": [], "embeds": []}
        for r in range(args.repeats + 1):  # round 0 warms up
            for name, prompts in (("ids", ids), ("embeds", embeds)):
                llm.reset_prefix_cache()
                seconds, _ = _timed(llm, [prompts[r]], first)
                if r:
                    times[name].append(seconds * 1e3)
        result["ttft_ms"][length] = {name: statistics.median(t) for name, t in times.items()}
        print(f"TTFT L={length}: ids {result['ttft_ms'][length]['ids']:.2f} ms, embeds "
              f"{result['ttft_ms'][length]['embeds']:.2f} ms", flush=True)
        if args.profile:
            import cProfile
            import pstats

            for name, prompt in (("ids", ids[0]), ("embeds", embeds[0])):
                llm.reset_prefix_cache()
                profiler = cProfile.Profile()
                profiler.runcall(_timed, llm, [prompt], first)
                print(f"--- profile L={length} {name}", flush=True)
                pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
    ids, embeds = _prompts(llm, args.num_prompts, args.len, seed=1)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rates = {"ids": [], "embeds": []}
    agree = None
    for r in range(args.repeats):
        for name, prompts in (("ids", ids), ("embeds", embeds)):
            llm.reset_prefix_cache()
            seconds, outputs = _timed(llm, prompts, params)
            rates[name].append(sum(len(o.outputs[0].token_ids) for o in outputs) / seconds)
            if name == "ids":
                reference = [o.outputs[0].token_ids for o in outputs]
            elif agree is None:
                agree = sum(o.outputs[0].token_ids == want for o, want in zip(outputs, reference)) / len(outputs)
    result["throughput"] = {name: statistics.median(r) for name, r in rates.items()}
    result["greedy_agreement"] = agree
    print(f"throughput {args.num_prompts} x ({args.len} + {args.max_tokens}): ids {result['throughput']['ids']:.0f} "
          f"tok/s, embeds {result['throughput']['embeds']:.0f} tok/s; greedy outputs equal in {agree:.0%}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
