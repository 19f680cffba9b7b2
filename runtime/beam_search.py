"""Beam search in the Python API (`LLM.beam_search`), built on the engine as vLLM's is.

NOTE (how it runs): every step, each live beam of every prompt is one engine request of its whole
token sequence with `max_tokens=1` and `logprobs=2 * beam_width`; each beam is extended by each of
its top tokens, and the `beam_width` best extensions by score survive (2 * beam_width candidates
per beam suffice: at most beam_width of a beam's extensions can be among the best). A beam ending
in eos (unless `ignore_eos`) is complete. Score: cumulative logprob / length ** length_penalty,
the length counting the prompt and not a final eos (vLLM's `get_beam_search_score`).

NOTE (KV sharing): beams share KV through the prefix cache, not by forking block tables: a beam's
request finds the full blocks of its prompt and of the tokens its ancestors computed already
cached (hashed by parent hash and token ids, reference-counted by the block pool), so a step
recomputes at most one block's worth of tokens per beam, and beams with a common prefix read the
same blocks. With `enable_prefix_caching` off every step recomputes every beam from scratch
(correct, slower).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmc.errors import RequestError
from llmc.runtime.sampling_params import SamplingParams


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams: `beam_width` beams kept, at most `max_tokens` generated."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise RequestError(f"BeamSearchParams.{name} must be an integer >= 1, got {value!r}")
        if not (isinstance(self.length_penalty, (int, float)) and math.isfinite(self.length_penalty)):
            raise RequestError(f"BeamSearchParams.length_penalty must be a finite number, got {self.length_penalty!r}")


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` holds the prompt's tokens and the generated ones (as vLLM's)."""

    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    """The best `beam_width` beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(tokens: list[int], cum_logprob: float, eos_token_ids: list[int], length_penalty: float) -> float:
    length = len(tokens) - (1 if tokens and tokens[-1] in eos_token_ids else 0)
    return cum_logprob / (length ** length_penalty)


def beam_search(llm, prompts: list[list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Beam search over prompts given as token ids (see the module's notes)."""
    engine = llm.engine
    eos, max_len = engine.eos_token_ids, engine.options.max_model_len
    score = lambda beam: beam_score(beam.tokens, beam.cum_logprob, eos, params.length_penalty)  # noqa: E731
    live = [[BeamSearchSequence(list(p))] for p in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    step_params = SamplingParams(max_tokens=1, logprobs=2 * params.beam_width, temperature=params.temperature,
                                 ignore_eos=params.ignore_eos, detokenize=False)
    for _ in range(params.max_tokens):
        flat = [(i, beam) for i, beams in enumerate(live) for beam in beams if len(beam.tokens) < max_len]
        if not flat:
            break
        outputs = llm.generate([{"prompt_token_ids": beam.tokens} for _, beam in flat], step_params)
        candidates: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        for (i, beam), output in zip(flat, outputs):
            top = output.outputs[0].logprobs[0]
            for token, logprob in top.items():
                child = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [top], beam.cum_logprob + logprob)
                if token in eos and not params.ignore_eos:
                    child.finish_reason = "stop"
                    done[i].append(child)
                else:
                    candidates[i].append(child)
        live = [sorted(c, key=score, reverse=True)[: params.beam_width] for c in candidates]
    results = []
    for i, prompt in enumerate(prompts):
        for beam in live[i]:
            beam.finish_reason = beam.finish_reason or "length"
        best = sorted(done[i] + live[i], key=score, reverse=True)[: params.beam_width]
        for beam in best:
            generated = beam.tokens[len(prompt):]
            if beam.finish_reason == "stop" and not params.include_stop_str_in_output:
                generated = generated[:-1]
            beam.text = llm.tokenizer.decode(generated, skip_special_tokens=True)
        results.append(BeamSearchOutput(best))
    return results
