"""Logits processing over lists of per-row parameters: what speculative decoding's verification
(runtime/spec_decode.py) samples from. The engine's per-step sampler is runtime/batch_sampler.py,
which keeps the same order and math over persistent device tensors.

NOTE (algorithm): the logits of every sampled row are processed together, as a
`[num_seqs, vocab_size]` tensor, in vLLM v1's order:

    logits_processors -> logit_bias, allowed_token_ids -> min_tokens (mask stop ids)
    -> repetition / frequency / presence penalties
    -> greedy rows: argmax
    -> other rows: temperature -> min_p -> top_k -> top_p -> softmax -> sample  (v1: min_p before top-k/top-p)

Python loops only build small per-row tensors (temperatures, bias indices, ...); the vocabulary
math is batched. `probs_for` gives the distribution each row is sampled from; spec_decode samples
it by an exponential race (a seeded row with BatchSampler's counter-based numbers). Logprobs are those of the
raw model distribution (`log_softmax` of the logits, before any processing), as vLLM returns them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmc.runtime.outputs import Logprob
from llmc.runtime.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """What the sampler needs about each row of a step; built by the engine once per step.

    One row per sampled sequence, in the order of the logits' rows.

    Fields:
        params: each row's sampling parameters.
        prompt_token_ids: each row's prompt (repetition_penalty counts it; logits processors
            with three arguments see it).
        output_token_ids: each row's generated tokens so far, before this step's token
            (penalties and min_tokens count them).
        eos_token_ids: the model's end-of-sequence ids (masked during min_tokens unless
            ignore_eos).
    """

    params: list[SamplingParams]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    eos_token_ids: list[int] | set[int]

    @property
    def num_seqs(self) -> int:
        return len(self.params)

    def __post_init__(self) -> None:
        lengths = {len(self.prompt_token_ids), len(self.output_token_ids)}
        if lengths != {self.num_seqs}:
            raise ValueError(f"SamplingMetadata rows disagree: {self.num_seqs} params, {lengths}")


def probs_for(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The distribution each row is sampled from, after all processing. [num_seqs, vocab_size].

    Greedy rows are one-hot at their argmax; a row whose constraints allow no token is all zeros.
    For rejection sampling (speculative decoding): give one row per position, with
    `output_token_ids` including the draft tokens before it.
    """
    logits = process_logits(logits.to(torch.float32, copy=True), metadata)
    blocked = logits.amax(dim=-1, keepdim=True) == float("-inf")  # [num_seqs, 1]
    probs = sampling_probs(logits, metadata.params)  # [num_seqs, vocab_size]
    greedy_rows = [i for i, p in enumerate(metadata.params) if p.is_greedy]
    if greedy_rows:
        rows = torch.tensor(greedy_rows, device=logits.device)
        one_hot = torch.zeros_like(probs[rows])  # [num_greedy, vocab_size]
        one_hot.scatter_(1, logits[rows].argmax(dim=-1, keepdim=True), 1.0)
        probs[rows] = one_hot
    return probs.masked_fill_(blocked, 0.0)


def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Processors, bias, allowed ids, min_tokens and penalties, in place; returns `logits`."""
    _apply_logits_processors(logits, metadata)
    _apply_logit_bias(logits, metadata.params)
    _apply_allowed_token_ids(logits, metadata.params)
    _apply_min_tokens(logits, metadata)
    _apply_penalties(logits, metadata)
    return logits


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, min_p, top_k, top_p, then softmax (vLLM v1's order); modifies `logits`. [num_seqs, vocab_size].

    Greedy rows get temperature 1 here; callers take their argmax instead.
    """
    device = logits.device
    temperatures = torch.tensor(
        [1.0 if p.is_greedy else p.temperature for p in params], device=device
    )  # [num_seqs]
    logits.div_(temperatures.unsqueeze(1))
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device)  # [num_seqs]
        _apply_min_p(logits, min_p)
    top_k = torch.tensor([p.top_k for p in params], device=device)  # [num_seqs]
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=device)  # [num_seqs]
        _apply_top_k_top_p(logits, top_k, top_p)
    elif any(p.top_k > 0 for p in params):
        _apply_top_k(logits, top_k, max(p.top_k for p in params))  # no full sort needed
    return torch.softmax(logits, dim=-1)


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: list[int] | torch.Tensor, num_top: int
) -> list[dict[int, float]]:
    """Logprobs of the prompt: row i is the model's distribution after prompt token i.

    `logits` [num_prompt_tokens, vocab_size]; `next_token_ids[i]` is the prompt token that
    followed (prompt token i + 1). Each dict holds it and the `num_top` most likely tokens, from
    the raw distribution. (The first prompt token has no logprob; the caller adds None.)
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [num_prompt_tokens, vocab_size]
    next_ids = torch.as_tensor(next_token_ids, device=logits.device)  # [num_prompt_tokens]
    return _gather_logprobs(logprobs, next_ids, [num_top] * logprobs.shape[0])


# -- logits processing (each step modifies `logits` [num_seqs, vocab_size] in place) ----------


def _apply_logits_processors(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    # User callables take one row each: an unavoidable per-row loop, skipped when none is set.
    for i, params in enumerate(metadata.params):
        for processor, arity in zip(params.logits_processors or (),
                                    params.logits_processor_arities):
            outputs = metadata.output_token_ids[i]
            if arity == 3:
                row = processor(metadata.prompt_token_ids[i], outputs, logits[i])
            else:
                row = processor(outputs, logits[i])
            logits[i] = row  # [vocab_size]


def _apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    rows, cols, values = [], [], []
    for i, p in enumerate(params):
        for token_id, bias in (p.logit_bias or {}).items():
            rows.append(i)
            cols.append(token_id)
            values.append(bias)
    if rows:
        device = logits.device
        index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
        logits.index_put_(index, torch.tensor(values, device=device), accumulate=True)


def _apply_allowed_token_ids(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    rows, cols = [], []
    for i, p in enumerate(params):
        for token_id in p.allowed_token_ids or ():
            rows.append(i)
            cols.append(token_id)
    if not rows:
        return
    device = logits.device
    is_allowed = torch.zeros_like(logits, dtype=torch.bool)  # [num_seqs, vocab_size]
    is_allowed[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = True
    has_list = torch.tensor([p.allowed_token_ids is not None for p in params], device=device)
    logits.masked_fill_(~is_allowed & has_list.unsqueeze(1), float("-inf"))


def _apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Until a row has `min_tokens` outputs, its stop tokens (and eos unless ignored) are masked."""
    vocab_size = logits.shape[1]
    rows, cols = [], []
    for i, p in enumerate(metadata.params):
        if len(metadata.output_token_ids[i]) < p.min_tokens:
            stop_ids = [t for t in p.all_stop_token_ids(metadata.eos_token_ids) if t < vocab_size]
            rows.extend([i] * len(stop_ids))
            cols.extend(stop_ids)
    if rows:
        device = logits.device
        logits[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = float("-inf")


def _apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """vLLM's penalties: repetition over prompt + output tokens, the other two over outputs."""
    rows = [i for i, p in enumerate(metadata.params) if p.has_penalties]
    if not rows:
        return
    device, vocab_size = logits.device, logits.shape[1]
    params = [metadata.params[i] for i in rows]
    row_index = torch.tensor(rows, device=device)
    row_logits = logits[row_index]  # [num_penalized, vocab_size]
    output_counts = _token_counts([metadata.output_token_ids[i] for i in rows], vocab_size, device)
    in_prompt = _token_counts([metadata.prompt_token_ids[i] for i in rows], vocab_size, device) > 0
    is_seen = in_prompt | (output_counts > 0)  # [num_penalized, vocab_size]

    def column(name: str) -> torch.Tensor:  # [num_penalized, 1]
        return torch.tensor([getattr(p, name) for p in params], device=device).unsqueeze(1)

    repetition = column("repetition_penalty")
    penalized = torch.where(row_logits > 0, row_logits / repetition, row_logits * repetition)
    row_logits = torch.where(is_seen, penalized, row_logits)
    row_logits -= column("frequency_penalty") * output_counts
    row_logits -= column("presence_penalty") * (output_counts > 0).float()
    logits[row_index] = row_logits


def _token_counts(token_lists: list[list[int]], vocab_size: int, device) -> torch.Tensor:
    """How often each vocabulary token occurs in each list. [num_lists, vocab_size] float32."""
    max_len = max((len(ids) for ids in token_lists), default=0)
    # Pad with an extra column `vocab_size` that is dropped afterwards.
    padded = torch.tensor(
        [ids + [vocab_size] * (max_len - len(ids)) for ids in token_lists],
        dtype=torch.int64, device=device,
    ).reshape(len(token_lists), max_len)  # [num_lists, max_len]
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab_size]


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> None:
    """`top_k` [num_seqs] (0 = off); `max_k` its largest value, a host int (so no device sync).
    Keeps entries >= the k-th largest (ties all kept)."""
    top_values = logits.topk(min(max_k, logits.shape[1]), dim=-1).values  # [num_seqs, max_k], descending
    k = top_k.clamp(min=1, max=top_values.shape[1])  # [num_seqs]
    kth_largest = top_values.gather(1, (k - 1).unsqueeze(1))  # [num_seqs, 1]
    logits.masked_fill_((logits < kth_largest) & (top_k > 0).unsqueeze(1), float("-inf"))


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> None:
    """`top_k` [num_seqs] (0 = off), `top_p` [num_seqs] (1 = off)."""
    vocab_size = logits.shape[1]
    sorted_logits, sorted_ids = logits.sort(dim=-1)  # [num_seqs, vocab_size], ascending
    # top_k: keep entries >= the k-th largest (ties at the threshold are all kept).
    k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size)  # [num_seqs]
    kth_largest = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))  # [num_seqs, 1]
    sorted_logits.masked_fill_(sorted_logits < kth_largest, float("-inf"))
    # top_p: drop a token when the tokens above it already hold >= top_p of the mass.
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [num_seqs, vocab_size]
    is_dropped = cumulative <= (1.0 - top_p).unsqueeze(1)
    is_dropped[:, -1] = False  # the most likely token always stays
    sorted_logits.masked_fill_(is_dropped, float("-inf"))
    logits.scatter_(1, sorted_ids, sorted_logits)


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens with prob < min_p * max prob; in log space: logit < max + log(min_p)."""
    max_logits = logits.max(dim=-1, keepdim=True).values  # [num_seqs, 1]
    threshold = max_logits + torch.log(min_p).unsqueeze(1)  # log(0) = -inf keeps everything
    logits.masked_fill_(logits < threshold, float("-inf"))


def _gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[dict[int, Logprob]]:
    """Per row: Logprob (value and rank) of `token_ids` [num_rows] plus of the top `num_top[row]`."""
    token_ids = token_ids.to(torch.int64)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [num_rows, 1]
    chosen_ranks = (logprobs > chosen).sum(dim=-1) + 1  # [num_rows]
    max_top = min(max(num_top, default=0), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(max_top, dim=-1)  # [num_rows, max_top]
    # One device-to-host copy per tensor, then plain Python.
    rows = zip(token_ids.tolist(), chosen.squeeze(1).tolist(), chosen_ranks.tolist(),
               top_ids.tolist(), top_values.tolist(), num_top)
    dicts = []
    for token_id, value, rank, ids, values, count in rows:
        logprob_dict = {token_id: Logprob(value, rank)}
        for position, (top_id, top_value) in enumerate(zip(ids[:count], values[:count])):
            logprob_dict.setdefault(top_id, Logprob(top_value, position + 1))
        dicts.append(logprob_dict)
    return dicts
