"""Structured-output overhead: generated tokens/s with and without a JSON schema, batch 1 and 64.

    python -P benchmarks/bench_structured.py --artifact build/ref-llama-12m [--device cpu] [--repeats 3]

Free rows generate `max_tokens` tokens (ignore_eos); guided rows stop where the schema's JSON ends (cap 160)
(every one validated with jsonschema), so throughput is tokens / second of each run. The guided
runs also count the host time spent filling bitmasks (`fill_bitmasks`) per step. Prints one JSON
object per configuration.
"""

from __future__ import annotations

import argparse
import json
import time

import jsonschema

from llmc.runtime import structured_output
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.structured_output import GuidedDecodingParams

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
                   "ok": {"type": "boolean"}},
    "required": ["name", "age", "tags", "ok"], "additionalProperties": False,
}


class _FillTimer:
    """Wraps the engine's fill_bitmasks to add up its time (the benchmark's own instrumentation)."""

    def __init__(self):
        self.seconds, self.calls, self._fill = 0.0, 0, structured_output.fill_bitmasks

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._fill(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def run(llm: LLM, batch: int, guided: bool, max_tokens: int) -> dict:
    import llmc.runtime.engine as engine_module

    timer = _FillTimer()
    engine_module.fill_bitmasks = timer
    try:
        guide = GuidedDecodingParams(json=SCHEMA) if guided else None
        params = SamplingParams(temperature=1.0, seed=None, max_tokens=160 if guided else max_tokens, ignore_eos=not guided,
                                guided_decoding=guide)
        start = time.perf_counter()
        outputs = llm.generate(["ROMEO:"] * batch, params)
        seconds = time.perf_counter() - start
    finally:
        engine_module.fill_bitmasks = structured_output.fill_bitmasks
    if guided:
        for output in outputs:
            jsonschema.validate(json.loads(output.outputs[0].text), SCHEMA)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"batch": batch, "guided": guided, "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1),
            "mask_ms_per_step": round(1e3 * timer.seconds / timer.calls, 3) if timer.calls else None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--artifact", required=True)
    parser.add_argument("--device", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    with LLM(args.artifact, device=args.device, max_num_seqs=64, disable_log_stats=True) as llm:
        run(llm, 4, True, args.max_tokens)  # warm up: the grammar compiler, the first steps
        for batch in (1, 64):
            for guided in (False, True):
                best = max((run(llm, batch, guided, args.max_tokens) for _ in range(args.repeats)),
                           key=lambda r: r["tokens_per_s"])
                print(json.dumps(best), flush=True)


if __name__ == "__main__":
    main()
