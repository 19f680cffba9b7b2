"""Host time of a final-only request's detokenization: its per-step calls and the call that finishes it.

    python benchmarks/detok_finish.py [--tokenizer checkpoints/ref-llama-12m] [--tokens 128] [--repeats 300]

A FINAL_ONLY request without stop strings defers decoding to its end (runtime/detokenizer.py); this
times `add_tokens` for the first tokens - 1 outputs (random ids) and for the last one, which decodes and
flushes the whole output, after a prompt of the same length. Prints µs per request for each.
"""

from __future__ import annotations

import argparse
import random
import time

from transformers import AutoTokenizer

from llmc.runtime.detokenizer import IncrementalDetokenizer
from llmc.runtime.sampling_params import RequestOutputKind, SamplingParams


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default="checkpoints/ref-llama-12m")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    rng = random.Random(0)
    special = set(tokenizer.all_special_ids)
    ids = [t for t in range(tokenizer.vocab_size) if t not in special]
    outputs, prompt = rng.choices(ids, k=args.tokens), rng.choices(ids, k=args.tokens)
    params = SamplingParams(max_tokens=args.tokens, temperature=0, output_kind=RequestOutputKind.FINAL_ONLY)
    steps = finish = 0.0
    for _ in range(args.repeats):
        detok = IncrementalDetokenizer(tokenizer, prompt, params)
        start = time.perf_counter()
        for token_id in outputs[:-1]:
            detok.add_tokens([token_id])
        middle = time.perf_counter()
        detok.add_tokens(outputs[-1:])
        steps, finish = steps + middle - start, finish + time.perf_counter() - middle
        assert detok.is_finished
    print(f"{args.tokens - 1} step calls {steps / args.repeats * 1e6:.1f} us, "
          f"the finishing call {finish / args.repeats * 1e6:.1f} us per request")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
