"""Speculative decoding by n-gram prompt lookup: config, proposer, verification sampler, stats.

NOTE (algorithm): a decoding request whose context repeats itself gets up to k draft tokens
from `NgramProposer` (the continuation of the most recent earlier occurrence of its last n
tokens). The engine feeds [last sampled token, draft_1..draft_k] in one forward pass and gets
k+1 logits rows; row i is the target distribution p_i after draft_1..draft_i. `rejection_sample`
then emits 1..k+1 tokens whose distribution is exactly that of plain decoding.

The draft is a point mass q = one-hot(d), so Leviathan et al.'s rule (accept with probability
min(1, p(d)/q(d)) = p(d); on rejection draw from normalize(max(p - q, 0)) = p with d zeroed) is
realised by drawing x ~ p_i with the sampler's exponential race and accepting iff x == d: the
acceptance probability is p_i(d), and a rejected x is distributed as p_i conditioned on x != d,
the residual. Position i is examined only after drafts 1..i-1 were accepted; after a rejection
x is the replacement, after k acceptances the draw at position k is the bonus token. Greedy rows
(one-hot p) thus accept exactly the drafts that equal the argmax.

Randomness: unseeded rows share one draw from a shared generator. A seeded row's position i draws
the counter-based numbers that BatchSampler draws for the same token number (`row_keys(seed, tokens
generated before it)`, batch_sampler's NOTE), so a seeded request's tokens do not depend on its batch
neighbours, nor on whether speculation ran (given the same probabilities), and nothing is rewound.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmc.errors import ConfigError
from llmc.runtime.batch_sampler import NO_TOKEN, exponentials, int64_seed, row_keys
from llmc.runtime.sampler import SamplingMetadata, compute_prompt_logprobs, probs_for
from llmc.schema import check_fields, opt, parse

METHODS = ("ngram", "draft_model", "eagle3", "eagle", "mtp")
# vLLM's older names of method mtp (it reads them as mtp): the checkpoint's own multi-token-prediction layer
MTP_ALIASES = ("deepseek_mtp", "glm4_moe_mtp")
MODEL_METHODS = ("draft_model", "eagle3", "eagle")  # the methods whose drafts come from speculative.model
NGRAM_DEFAULTS = {"prompt_lookup_min": 1, "prompt_lookup_max": 4}


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """The `speculative` options of the engine (a boundary object: engine → scheduler/runner).

    Fields:
        method: how drafts are proposed: "ngram" (prompt lookup), "draft_model" (a smaller llmc
            artifact's greedy tokens, runtime/spec_draft.py), "eagle3" (an EAGLE-3 head reading the
            model's hidden states, runtime/spec_eagle.py), "eagle" (an EAGLE-1 head) or "mtp" (the artifact's own
            multi-token-prediction layer, GLM-4.5's or DeepSeek-V3's: runtime/mtp_head.py; vLLM's older names
            deepseek_mtp and glm4_moe_mtp are read as mtp); default (vLLM's rule): with `model`, eagle3
            where its name says "eagle3", eagle where it says "eagle-", else draft_model; without, ngram.
        model: the draft model's artifact folder (draft_model), the EAGLE head's Hugging Face
            folder (eagle3, eagle).
        num_speculative_tokens: k, the most draft tokens proposed per request and step.
        prompt_lookup_min: shortest suffix n-gram that is looked up (ngram only; default 1).
        prompt_lookup_max: longest suffix n-gram that is looked up, tried first (ngram only; default 4).
        disable_by_batch_size: no drafts while more requests than this are running (large
            batches are compute-bound and gain nothing); None = never disabled.
    """

    method: str | None = opt(None, choices=list(METHODS + MTP_ALIASES),
                              help="draft proposer: ngram, draft_model, eagle3, eagle or mtp")
    model: str | None = opt(None, help="the draft model (a built llmc artifact sharing the model's tokenizer) or EAGLE head (its HF folder)")
    num_speculative_tokens: int = opt(min=1, help="draft tokens per request and step, k")
    prompt_lookup_min: int | None = opt(None, min=1, help="shortest n-gram looked up (ngram)")
    prompt_lookup_max: int | None = opt(None, min=1, help="longest n-gram looked up (ngram)")
    disable_by_batch_size: int | None = opt(None, min=1, help="no speculation above this batch")

    def __post_init__(self) -> None:
        # Constructed from Python (not from_dict), types are not checked by the schema.
        for name in ("method", "model"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"speculative.{name}: expected a string, got {value!r}")
        method = self.method or default_method(self.model)
        method = "mtp" if method in MTP_ALIASES else method
        object.__setattr__(self, "method", method)
        if method in MODEL_METHODS:
            if self.model is None:
                what = {"draft_model": "the draft model's artifact folder", "eagle3": "the EAGLE-3 head's folder",
                        "eagle": "the EAGLE head's folder"}[method]
                raise ConfigError(f"speculative.method {method} needs speculative.model, {what}")
            given = [name for name in NGRAM_DEFAULTS if getattr(self, name) is not None]
            if given:
                raise ConfigError(f"speculative.{given[0]} is an n-gram setting; method {method} does not read it: drop it")
        elif method == "mtp":
            if self.model is not None:
                raise ConfigError("speculative.model: method mtp runs the artifact's own multi-token-prediction layer; "
                                  "drop speculative.model")
            given = [name for name in NGRAM_DEFAULTS if getattr(self, name) is not None]
            if given:
                raise ConfigError(f"speculative.{given[0]} is an n-gram setting; method mtp does not read it: drop it")
        else:
            if self.model is not None and method in METHODS:
                raise ConfigError(f"speculative.model is the draft model of method draft_model, not {method}; "
                                  "drop one of them")
            for name, default in NGRAM_DEFAULTS.items():
                if getattr(self, name) is None:
                    object.__setattr__(self, name, default)
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "disable_by_batch_size"):
            value = getattr(self, name)
            is_int = isinstance(value, int) and not isinstance(value, bool)
            if not is_int and not (value is None and name != "num_speculative_tokens"):
                raise ConfigError(f"speculative.{name}: expected an integer, got {value!r}")
        check_fields(self, "speculative", ConfigError)
        if method == "ngram" and self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"speculative.prompt_lookup_min ({self.prompt_lookup_min}) must be at most "
                f"prompt_lookup_max ({self.prompt_lookup_max}); lower it or raise the max"
            )

    @classmethod
    def from_dict(cls, data: dict) -> SpeculativeConfig:
        """Strict: an unknown key, a wrong type or a bad value is a one-line ConfigError."""
        return parse(cls, data, "speculative", ConfigError)

    def is_enabled_for(self, num_running: int) -> bool:
        """Whether to propose drafts in a step with `num_running` running requests."""
        return self.disable_by_batch_size is None or num_running <= self.disable_by_batch_size


def default_method(model: str | None) -> str:
    """vLLM's method for a speculative config that names none: by the draft's name (EAGLE heads are published as
    .../EAGLE3-... and .../EAGLE-...), else a draft model; ngram without one."""
    if model is None:
        return "ngram"
    name = model.lower() if isinstance(model, str) else ""
    return "eagle3" if "eagle3" in name else "eagle" if "eagle-" in name else "draft_model"


class NgramProposer:
    """Prompt-lookup decoding: drafts are copied from earlier in the request's own tokens."""

    fills_drafts = False  # its drafts are tokens when proposed (`propose`), not placeholders a `fill` sets

    def __init__(self, config: SpeculativeConfig):
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def close(self) -> None:
        """Nothing to release."""

    def propose(self, token_ids: list[int]) -> list[int]:
        """Up to k draft tokens to follow `token_ids` (prompt + generated so far); [] if none.

        The longest suffix n-gram (max_n down to min_n) that occurred earlier wins, at its most
        recent occurrence; the draft is what followed it. When that occurrence overlaps the
        suffix (a loop of period `lag` < k), the continuation keeps repeating with that period.
        """
        num_tokens = len(token_ids)
        max_n = min(self.max_n, num_tokens - 1)  # an earlier occurrence needs n < num_tokens
        if max_n < self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)  # [num_tokens]
        # Candidates: positions `end` (not the last) where an occurrence of the suffix would end.
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # [num_candidates], ascending
        match_lens = np.ones_like(ends)  # suffix tokens matched so far, backwards from `end`
        is_matching = np.ones(ends.shape, dtype=bool)
        for back in range(1, max_n):
            is_matching &= ends >= back
            is_matching[is_matching] = tokens[ends[is_matching] - back] == tokens[-1 - back]
            match_lens += is_matching
        for n in range(max_n, self.min_n - 1, -1):
            (hits,) = np.nonzero(match_lens >= n)
            if hits.size:
                return self._continuation(token_ids, int(ends[hits[-1]]))
        return []

    def _continuation(self, token_ids: list[int], end: int) -> list[int]:
        """k tokens after position `end`, repeating tokens[end+1:] if it is shorter than k."""
        following = token_ids[end + 1 :]  # non-empty: end < len(token_ids) - 1
        k = self.num_speculative_tokens
        if len(following) >= k:
            return following[:k]
        return [following[j % len(following)] for j in range(k)]


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: list[list[int]],
    seeds: list[tuple[int, int] | None],
    shared_generator: torch.Generator | None,
    is_greedy: list[bool] | None = None,
) -> list[list[int]]:
    """Verify each row's drafts against its target distributions; 1..k_r+1 tokens per row.

    `target_probs` [num_rows, max_k + 1, vocab_size]: row r's positions 0..k_r are p_0..p_k_r
    (`probs_for` of the verify logits; greedy rows one-hot), the rest is padding and ignored.
    `draft_token_ids[r]` holds row r's k_r <= max_k drafts (k_r = 0: plain sampling from p_0).
    `seeds[r]`: (seed, tokens the request generated so far) for a seeded request, whose position i
    draws the counter-based numbers BatchSampler draws for its token number `so far + i` (so its tokens
    do not depend on whether speculation ran); None: `shared_generator` (None: torch's default).
    `is_greedy[r]` rows take the argmax and draw nothing (default: no row is greedy; a one-hot row
    gives the same tokens either way).
    Returns per row: the accepted drafts followed by one replacement or bonus token, which is
    NO_TOKEN where the position's distribution is all zeros (its constraints allow no token).
    """
    num_rows, num_positions, vocab_size = target_probs.shape
    num_drafts = [len(drafts) for drafts in draft_token_ids]
    if len(num_drafts) != num_rows or len(seeds) != num_rows:
        raise ValueError(f"rejection_sample: {num_rows} rows, {len(num_drafts)} draft lists, "
                         f"{len(seeds)} seeds")
    if max(num_drafts, default=0) >= num_positions:
        raise ValueError(f"rejection_sample: {max(num_drafts)} drafts need more than "
                         f"{num_positions} positions")
    is_greedy = is_greedy or [False] * num_rows
    probs = target_probs.to(torch.float32)  # [num_rows, num_positions, vocab_size]
    q = torch.empty_like(probs).exponential_(generator=shared_generator)
    vocab_ids = torch.arange(vocab_size, device=probs.device)
    for row, seed in enumerate(seeds):
        if seed is not None and not is_greedy[row]:
            positions = torch.arange(num_drafts[row] + 1, device=probs.device) + seed[1]
            keys = row_keys(torch.full_like(positions, int64_seed(seed[0])), positions)
            q[row, : num_drafts[row] + 1] = exponentials(keys, vocab_ids)
    # Exp(1) can return exactly 0; 0/0 would be NaN and win argmax (as in the sampler).
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    sampled = (probs / q).argmax(dim=-1)  # [num_rows, num_positions]
    if any(is_greedy):
        greedy_rows = torch.tensor(is_greedy, device=probs.device).unsqueeze(1)
        sampled = torch.where(greedy_rows, probs.argmax(dim=-1), sampled)
    sampled.masked_fill_(probs.amax(dim=-1) == 0, NO_TOKEN)  # never equal to a draft: rejected
    drafts, has_draft = _pad_drafts(draft_token_ids, num_positions, probs.device)
    # A position rejects when its draw differs from its draft; the padding always "rejects".
    is_rejected = (sampled != drafts) | ~has_draft  # [num_rows, num_positions]
    num_accepted = is_rejected.int().argmax(dim=-1)  # [num_rows]: first rejected position
    sampled_rows, accepted_counts = sampled.tolist(), num_accepted.tolist()  # one sync
    return [tokens[: count + 1] for tokens, count in zip(sampled_rows, accepted_counts)]


def greedy_verify(logits: torch.Tensor, draft_token_ids: list[list[int]]) -> list[list[int]]:
    """rejection_sample's result where every request is greedy and nothing acts on its logits (their one-hot
    distributions need not be made): `logits` [sum(k_r + 1), vocab_size], request r's k_r + 1 rows consecutive; per
    request its drafts up to the first that is not its position's argmax, then that position's argmax (NO_TOKEN where
    every logit is -inf: a grammar or bad word left no token). Two device ops and one copy to the host."""
    tokens = logits.argmax(dim=-1).masked_fill_(logits.amax(dim=-1) == float("-inf"), NO_TOKEN).tolist()
    sampled, start = [], 0
    for drafts in draft_token_ids:
        row = tokens[start : start + len(drafts) + 1]
        accepted = next((i for i, (d, t) in enumerate(zip(drafts, row)) if d != t), len(drafts))
        sampled.append(row[: accepted + 1])
        start += len(drafts) + 1
    return sampled


def _pad_drafts(draft_token_ids: list[list[int]], num_positions: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts as [num_rows, num_positions] int64 (zero-padded) and where they are real."""
    num_rows = len(draft_token_ids)
    drafts = torch.zeros(num_rows, num_positions, dtype=torch.int64)
    has_draft = torch.zeros(num_rows, num_positions, dtype=torch.bool)
    for row, ids in enumerate(draft_token_ids):
        drafts[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        has_draft[row, : len(ids)] = True
    return drafts.to(device), has_draft.to(device)


@dataclass
class SpeculativeOutput:
    """The verify sampler's result, one entry per request.

    Fields:
        token_ids: the tokens to append: accepted drafts, then one sampled token (1..k+1), or
            only the accepted drafts (0..k) where the next position had no token allowed.
        logprobs: per request, None if its params ask no logprobs, else one dict per token of
            `token_ids` (raw logprobs of the token and the top `logprobs` tokens, as `Sampler`).
        no_token_allowed: per request, whether its constraints allowed no token after `token_ids`
            (the sequence ends there).
    """

    token_ids: list[list[int]]
    logprobs: list[list[dict[int, float]] | None]
    no_token_allowed: list[bool]


def verify_metadata(metadata: SamplingMetadata,
                    draft_token_ids: list[list[int]]) -> SamplingMetadata:
    """One row per verified position: request r gives k_r + 1 rows, the i-th seeing
    output_token_ids + drafts[:i] (for penalties, min_tokens and logits processors)."""
    rows: list[tuple[int, list[int]]] = []  # (request index, output tokens before the position)
    for r, drafts in enumerate(draft_token_ids):
        outputs = list(metadata.output_token_ids[r])
        rows.extend((r, outputs + drafts[:i]) for i in range(len(drafts) + 1))
    return SamplingMetadata(
        params=[metadata.params[r] for r, _ in rows],
        prompt_token_ids=[metadata.prompt_token_ids[r] for r, _ in rows],
        output_token_ids=[outputs for _, outputs in rows],
        eos_token_ids=metadata.eos_token_ids,
    )


def sample_with_drafts(logits: torch.Tensor, metadata: SamplingMetadata,
                       draft_token_ids: list[list[int]],
                       shared_generator: torch.Generator | None,
                       logprob_logits: torch.Tensor | None = None) -> SpeculativeOutput:
    """The engine's one call: `logits` [sum(k_r + 1), vocab_size], request r's k_r + 1 verify
    rows consecutive and in `metadata`'s order; `metadata` has one row per request.
    `logprob_logits`: the rows the reported logprobs are taken from (default `logits`)."""
    num_rows_per_request = [len(drafts) + 1 for drafts in draft_token_ids]
    if logits.dim() != 2 or logits.shape[0] != sum(num_rows_per_request):
        raise ValueError(f"logits {tuple(logits.shape)} for {sum(num_rows_per_request)} "
                         "verify rows")
    if all(p.is_greedy and not p.changes_logits for p in metadata.params):
        sampled = greedy_verify(logits, draft_token_ids)
    else:
        flat_probs = probs_for(logits, verify_metadata(metadata, draft_token_ids))
        target_probs = _pad_positions(flat_probs, num_rows_per_request)
        seeds = [None if p.seed is None else (p.seed, len(outputs))
                 for p, outputs in zip(metadata.params, metadata.output_token_ids)]
        sampled = rejection_sample(target_probs, draft_token_ids, seeds, shared_generator,
                                   [p.is_greedy for p in metadata.params])
    no_token_allowed = [tokens[-1] == NO_TOKEN for tokens in sampled]
    token_ids = [tokens[:-1] if blocked else tokens for tokens, blocked in zip(sampled, no_token_allowed)]
    logprobs: list[list[dict[int, float]] | None] = [None] * len(token_ids)
    starts = np.cumsum([0, *num_rows_per_request]).tolist()
    for r, (params, tokens) in enumerate(zip(metadata.params, token_ids)):
        if params.logprobs is not None:
            rows = (logits if logprob_logits is None else logprob_logits)[starts[r] : starts[r] + len(tokens)]
            logprobs[r] = compute_prompt_logprobs(rows, tokens, params.logprobs)
    return SpeculativeOutput(token_ids, logprobs, no_token_allowed)


def _pad_positions(flat: torch.Tensor, num_rows_per_request: list[int]) -> torch.Tensor:
    """[sum(n_r), vocab_size] → [num_requests, max(n_r), vocab_size], zero-padded."""
    padded = flat.new_zeros(len(num_rows_per_request), max(num_rows_per_request), flat.shape[1])
    chunks = torch.split(flat, num_rows_per_request)
    for r, chunk in enumerate(chunks):
        padded[r, : chunk.shape[0]] = chunk
    return padded


@dataclass
class SpecDecodeStats:
    """Cumulative speculation counters (for `Engine.stats()` and metrics).

    Fields:
        num_proposed: draft tokens verified.
        num_accepted: of those, drafts accepted.
        num_draft_steps: request-steps that verified at least one draft.
        num_emitted: tokens emitted by those request-steps (accepted + one each).
    """

    num_proposed: int = 0
    num_accepted: int = 0
    num_draft_steps: int = 0
    num_emitted: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed drafts; 0.0 before any draft."""
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        """Tokens per request-step with drafts (1 = no gain, k + 1 = every draft accepted)."""
        return self.num_emitted / self.num_draft_steps if self.num_draft_steps else 0.0

    def record(self, draft_token_ids: list[list[int]], token_ids: list[list[int]],
               no_token_allowed: list[bool] | None = None) -> None:
        """Count one step: each row's drafts and the tokens `sample_with_drafts` emitted for it (all
        accepted drafts where the position after them had no token allowed)."""
        no_token_allowed = no_token_allowed or [False] * len(token_ids)
        for drafts, tokens, blocked in zip(draft_token_ids, token_ids, no_token_allowed, strict=True):
            if drafts:
                self.num_proposed += len(drafts)
                self.num_accepted += len(tokens) - (0 if blocked else 1)
                self.num_draft_steps += 1
                self.num_emitted += len(tokens)

    def as_dict(self) -> dict[str, float | int]:
        return {
            "spec_num_proposed_tokens": self.num_proposed,
            "spec_num_accepted_tokens": self.num_accepted,
            "spec_num_draft_steps": self.num_draft_steps,
            "spec_acceptance_rate": self.acceptance_rate,
            "spec_mean_tokens_per_step": self.mean_tokens_per_step,
        }
