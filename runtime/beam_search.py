"""Beam search in the Python API (`LLM.beam_search`), with vLLM's BeamSearchParams and outputs.

NOTE (how it runs): a prompt becomes one engine request with `use_beam_search` and n = beam_width
(runtime/beam_group.py): its beams are long-lived sequences that share KV blocks through the block
pool's reference counts, a beam continuing with several tokens forks its block table, and the first
write into a shared, partly filled last block copies that block (runtime/beam_scheduler.py). Every
prompt's search runs in the same engine steps, beside any other request.

NOTE (fallback): an engine that cannot copy KV blocks (an ONNX artifact, tensor/pipeline ranks) or
speculates runs `beam_search_by_requests`, vLLM v1's way: every round, each live beam is a new
engine request of its whole sequence with max_tokens=1 and logprobs=2*beam_width, its KV found
again through the prefix cache (at most a block's worth recomputed per beam and round; everything
without prefix caching). It scores beams the same way, so both return the same beams.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmc.errors import RequestError
from llmc.runtime.beam_group import beam_score, check_beam_width
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


def can_fork_beams(engine) -> bool:
    """Whether the engine runs `use_beam_search` requests (KV blocks copied, no speculation)."""
    return getattr(engine.runner, "copy_blocks", None) is not None and engine.proposer is None


def beam_search(llm, prompts: list[list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Beam search over prompts given as token ids (see the module's notes)."""
    if not can_fork_beams(llm.engine):
        return beam_search_by_requests(llm, prompts, params)
    sampling = SamplingParams(n=params.beam_width, use_beam_search=True, max_tokens=params.max_tokens,
                              temperature=params.temperature, ignore_eos=params.ignore_eos,
                              length_penalty=params.length_penalty,
                              include_stop_str_in_output=params.include_stop_str_in_output)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling)
    results = []
    for prompt, output in zip(prompts, outputs):
        results.append(BeamSearchOutput([
            BeamSearchSequence(list(prompt) + c.token_ids, c.logprobs, c.cumulative_logprob, c.text, c.finish_reason)
            for c in output.outputs]))
    return results


def beam_search_by_requests(llm, prompts: list[list[int]], params: BeamSearchParams) -> list[BeamSearchOutput]:
    """The fallback: one max_tokens=1 request per live beam and round (see the module's notes)."""
    engine = llm.engine
    check_beam_width("beam_width", params.beam_width, engine.max_logprobs)  # its requests ask 2 x width logprobs
    eos, max_len = engine.eos_token_ids, engine.options.max_model_len
    for prompt in prompts:  # as the engine's search refuses it (Engine._check_prompt), before any round
        engine._check_prompt(list(prompt), SamplingParams())
    score = lambda beam: beam_score(beam.tokens, beam.cum_logprob, eos, params.length_penalty)  # noqa: E731
    live = [[BeamSearchSequence(list(p))] for p in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    step_params = SamplingParams(max_tokens=1, logprobs=2 * params.beam_width, temperature=params.temperature,
                                 ignore_eos=params.ignore_eos, detokenize=False)
    for _ in range(params.max_tokens):
        for i, beams in enumerate(live):  # a beam at max_model_len ends by length, as in the engine's search
            done[i] += [beam for beam in beams if len(beam.tokens) >= max_len]
            live[i] = [beam for beam in beams if len(beam.tokens) < max_len]
        flat = [(i, beam) for i, beams in enumerate(live) for beam in beams]
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
        for beam in live[i] + done[i]:
            beam.finish_reason = beam.finish_reason or "length"
        best = sorted(done[i] + live[i], key=score, reverse=True)[: params.beam_width]
        for beam in best:
            generated = beam.tokens[len(prompt):]
            if beam.finish_reason == "stop" and not params.include_stop_str_in_output:
                generated = generated[:-1]
            beam.text = llm.tokenizer.decode(generated, skip_special_tokens=True)
        results.append(BeamSearchOutput(best))
    return results
