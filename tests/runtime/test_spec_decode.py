"""Speculative decoding pieces: n-gram proposer, config, rejection sampler, verify helpers, stats."""

import random

import pytest
import torch

from llmc.errors import ConfigError
from llmc.runtime.sampler import SamplingMetadata, probs_for
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.spec_decode import (
    NO_TOKEN,
    NgramProposer,
    SpecDecodeStats,
    SpeculativeConfig,
    _pad_positions,
    rejection_sample,
    sample_with_drafts,
    verify_metadata,
)

# chi-square critical value at p = 0.001 for 3 degrees of freedom (a vocabulary of 4)
CHI2_3DOF_P001 = 16.27
NUM_DRAWS = 20_000


def proposer(k=3, lo=1, hi=4) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=lo,
                                           prompt_lookup_max=hi))


def reference_propose(tokens, k, lo, hi):
    """Brute force: longest n first, most recent start, continuation copied token by token."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                extended = list(tokens)
                for j in range(k):
                    extended.append(extended[start + n + j])
                return extended[len(tokens):]
    return []


def metadata(params, outputs=None) -> SamplingMetadata:
    return SamplingMetadata(
        params=list(params),
        prompt_token_ids=[[] for _ in params],
        output_token_ids=outputs or [[] for _ in params],
        eos_token_ids=[0],
    )


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# -- proposer --------------------------------------------------------------------------------


def test_longest_ngram_is_preferred():
    # "2" last occurred at index 4 (followed by 5), but "1 2" occurred at 0 (followed by 3 9).
    assert proposer(k=2).propose([1, 2, 3, 9, 2, 5, 1, 2]) == [3, 9]
    assert proposer(k=2, hi=1).propose([1, 2, 3, 9, 2, 5, 1, 2]) == [5, 1]


def test_most_recent_occurrence_wins():
    assert proposer(k=3).propose([1, 2, 3, 1, 2, 4, 1, 2]) == [4, 1, 2]


def test_no_match_gives_nothing():
    assert proposer().propose([1, 2, 3, 4]) == []
    assert proposer().propose([7]) == []
    assert proposer().propose([]) == []


def test_respects_k_and_lookup_bounds():
    tokens = [5, 6, 7, 8, 9, 10, 5]
    assert proposer(k=2).propose(tokens) == [6, 7]
    assert proposer(k=5).propose(tokens) == [6, 7, 8, 9, 10]
    assert proposer(k=2, lo=2).propose(tokens) == []  # only a 1-gram matches
    assert proposer(k=2, lo=2, hi=2).propose([1, 4, 5, 4, 1, 4]) == [5, 4]


def test_a_loop_keeps_repeating():
    assert proposer(k=3).propose([5, 5, 5]) == [5, 5, 5]
    assert proposer(k=5).propose([9, 1, 2, 1, 2]) == [1, 2, 1, 2, 1]


def test_matches_brute_force_on_random_sequences():
    rng = random.Random(0)
    for _ in range(400):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(0, 30))]
        k, lo = rng.randrange(1, 6), rng.randrange(1, 4)
        hi = rng.randrange(lo, 6)
        assert proposer(k, lo, hi).propose(tokens) == reference_propose(tokens, k, lo, hi), tokens


# -- config ----------------------------------------------------------------------------------


def test_config_defaults_and_from_dict():
    config = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (1, 4)
    assert config.disable_by_batch_size is None and config.is_enabled_for(10_000)
    limited = SpeculativeConfig(num_speculative_tokens=2, disable_by_batch_size=8)
    assert limited.is_enabled_for(8) and not limited.is_enabled_for(9)


@pytest.mark.parametrize("data, field", [
    ({}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "method": "medusa"}, "method"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 5}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"num_speculative_tokens": 2, "lookup_max": 3}, "lookup_max"),
])
def test_config_errors_name_the_field(data, field):
    with pytest.raises(ConfigError, match=field) as info:
        SpeculativeConfig.from_dict(data)
    assert "\n" not in str(info.value)


def test_config_checks_types_from_python():
    with pytest.raises(ConfigError, match="prompt_lookup_max"):
        SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=2.0)


# -- rejection sampler -----------------------------------------------------------------------


def one_hot(ids, vocab=6) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


@pytest.mark.parametrize("is_greedy", [[True, True, True], None])
def test_greedy_accepts_the_argmax_prefix_then_emits_the_argmax(is_greedy):
    targets = torch.stack([one_hot([3, 1, 4, 2]), one_hot([3, 1, 4, 2]), one_hot([5, 0, 0, 0])])
    drafts = [[3, 1, 0], [3, 1, 4], []]
    out = rejection_sample(targets, drafts, [None] * 3, torch.Generator().manual_seed(0),
                           is_greedy)
    assert out == [[3, 1, 4], [3, 1, 4, 2], [5]]


def draw_many(p0, p1, draft, seed=0):
    """First and second emitted token of NUM_DRAWS independent rows with one draft each."""
    targets = torch.stack([p0, p1]).expand(NUM_DRAWS, 2, len(p0))
    out = rejection_sample(targets, [[draft]] * NUM_DRAWS, [None] * NUM_DRAWS,
                           torch.Generator().manual_seed(seed))
    return out


P0 = torch.tensor([0.5, 0.3, 0.15, 0.05])
P1 = torch.tensor([0.1, 0.2, 0.3, 0.4])


@pytest.mark.parametrize("draft", [0, 3], ids=["likely-draft", "unlikely-draft"])
def test_first_token_is_distributed_as_p0(draft):
    out = draw_many(P0, P1, draft)
    counts = torch.bincount(torch.tensor([tokens[0] for tokens in out]), minlength=4).float()
    assert chi_square(counts, P0) < CHI2_3DOF_P001
    accepted = sum(len(tokens) == 2 for tokens in out) / NUM_DRAWS
    assert accepted == pytest.approx(float(P0[draft]), abs=0.015)


@pytest.mark.parametrize("draft", [0, 3], ids=["likely-draft", "unlikely-draft"])
def test_token_after_an_accepted_draft_is_distributed_as_p1(draft):
    out = draw_many(P0, P1, draft, seed=1)
    seconds = [tokens[1] for tokens in out if len(tokens) == 2]
    assert all(tokens[0] == draft for tokens in out if len(tokens) == 2)
    assert len(seconds) > 500
    counts = torch.bincount(torch.tensor(seconds), minlength=4).float()
    assert chi_square(counts, P1) < CHI2_3DOF_P001


def test_a_rejected_draft_is_replaced_from_the_residual():
    out = draw_many(P0, P1, draft=0, seed=2)
    replacements = [tokens[0] for tokens in out if len(tokens) == 1]
    assert 0 not in replacements
    residual = torch.tensor([0.0, 0.3, 0.15, 0.05])[1:] / 0.5
    counts = torch.bincount(torch.tensor(replacements), minlength=4).float()[1:]
    assert chi_square(counts, residual) < 13.82  # 2 degrees of freedom, p = 0.001


def test_seeded_rows_are_reproducible_and_independent_of_neighbours():
    probs = torch.softmax(torch.randn(5, 4, 50, generator=torch.Generator().manual_seed(3)), -1)
    drafts = [[1, 2, 3], [4], [], [7, 8, 9], [0, 0]]

    def seeded_run(rows, shared_seed):
        seeds = [(100 + r, 5) if r in (0, 3) else None for r in rows]
        out = rejection_sample(probs[rows], [drafts[r] for r in rows], seeds,
                               torch.Generator().manual_seed(shared_seed))
        return {r: tokens for r, tokens in zip(rows, out) if r in (0, 3)}, seeds

    alone, _ = seeded_run([0], 0)
    together, _ = seeded_run([4, 0, 1, 3, 2], 5)
    again, _ = seeded_run([3, 0], 9)
    assert alone[0] == together[0] == again[0]
    assert together[3] == again[3]


def test_seeded_tokens_equal_plain_sampling_whatever_the_drafts():
    """Same probabilities per position: drafts must not change a seeded request's tokens (the
    speculative engine's steps without drafts sample through the same path with no drafts)."""
    vocab, num_steps = 8, 40
    logits = torch.randn(num_steps + 8, vocab, generator=torch.Generator().manual_seed(4)) * 0.5
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=num_steps)
    plain = []
    for t in range(num_steps):  # the metadata carries the tokens so far, as the engine's does
        plain.append(sample_with_drafts(logits[t : t + 1], metadata([params], [list(plain)]), [[]], None).token_ids[0][0])

    rng, spec = random.Random(0), []
    while len(spec) < num_steps:
        t, k = len(spec), rng.randrange(0, 4)
        guess = plain[t : t + k]  # mostly right, sometimes wrong
        drafts = [tok if rng.random() < 0.7 else (tok + 1) % vocab for tok in guess]
        out = sample_with_drafts(logits[t : t + len(drafts) + 1], metadata([params], [list(spec)]), [drafts], None)
        spec.extend(out.token_ids[0])
    assert spec[:num_steps] == plain
    assert len(set(plain)) > 2  # the draws move on with the position (a fixed draw would repeat one token)


def test_rejection_sample_checks_shapes():
    with pytest.raises(ValueError, match="positions"):
        rejection_sample(torch.ones(1, 2, 4) / 4, [[1, 2]], [None], None)
    with pytest.raises(ValueError, match="rows"):
        rejection_sample(torch.ones(2, 2, 4) / 4, [[1]], [None], None)


# -- the engine-facing helpers -----------------------------------------------------------------


def test_verify_metadata_gives_each_position_the_drafts_before_it():
    meta = metadata([SamplingParams(temperature=0), SamplingParams(seed=3)], [[9], [8, 7]])
    expanded = verify_metadata(meta, [[1, 2], []])
    assert expanded.output_token_ids == [[9], [9, 1], [9, 1, 2], [8, 7]]
    assert expanded.params[3] is meta.params[1]  # row 3 is request 1's (its seed keys its draws)


def test_penalties_see_earlier_drafts():
    # Token 2 leads at both positions, but once drafted it is penalised below token 1.
    logits = torch.tensor([[0.0, 1.0, 1.5, 0.0]] * 2)
    params = SamplingParams(temperature=0, frequency_penalty=1.0)
    out = sample_with_drafts(logits, metadata([params]), [[2]], None)
    assert out.token_ids == [[2, 1]]


def test_sample_with_drafts_returns_logprobs_per_emitted_token():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0.3, 0.3, 0.4]]))
    params = [SamplingParams(temperature=0, logprobs=1), SamplingParams(temperature=0)]
    out = sample_with_drafts(logits, metadata(params), [[0], []], None)
    assert out.token_ids == [[0, 2], [2]]
    first, second = out.logprobs[0]
    assert first[0] == pytest.approx(torch.log(torch.tensor(0.7)).item(), abs=1e-5)
    assert list(second) == [2]
    assert out.logprobs[1] is None


def test_stats_count_proposed_and_accepted():
    stats = SpecDecodeStats()
    assert stats.acceptance_rate == 0.0
    stats.record([[1, 2, 3], [], [4]], [[1, 2, 5], [6], [7]])
    assert (stats.num_proposed, stats.num_accepted, stats.num_draft_steps) == (4, 2, 2)
    assert stats.acceptance_rate == 0.5
    assert stats.as_dict()["spec_mean_tokens_per_step"] == 2.0


@pytest.mark.parametrize("seed", range(3))
def test_greedy_verify_gives_rejection_sampling_of_one_hot_rows(seed):
    """An all-greedy batch with nothing acting on its logits skips the distributions (greedy_verify); its tokens are
    rejection sampling's over the one-hot rows `probs_for` makes (the path any other batch takes): random logits with
    ties, drafts that agree for a while (0 .. k of them), requests without drafts, and rows every logit of which is -inf
    (a grammar left no token: NO_TOKEN, a rejection)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    drafts = [[] if rng.random() < 0.2 else [0] * rng.randint(1, 4) for _ in range(12)]
    logits = torch.randint(0, 4, (sum(len(d) + 1 for d in drafts), 7), generator=gen).float()  # ties
    logits[rng.sample(range(logits.shape[0]), 3)] = float("-inf")
    argmax, start = logits.argmax(dim=-1).tolist(), 0
    for d in drafts:  # each request agrees with its argmax for a random number of drafts, then (maybe) not
        agree = rng.randint(0, len(d))
        d[:] = [argmax[start + i] if i < agree else (argmax[start + i] + 1) % 7 for i in range(len(d))]
        start += len(d) + 1
    params = [SamplingParams(temperature=0) for _ in drafts]
    fast = sample_with_drafts(logits, metadata(params), drafts, None)
    reference = rejection_sample(_pad_positions(probs_for(logits, verify_metadata(metadata(params), drafts)),
                                                [len(d) + 1 for d in drafts]),
                                 drafts, [None] * len(drafts), None, [True] * len(drafts))
    assert [t + ([NO_TOKEN] if blocked else []) for t, blocked in zip(fast.token_ids, fast.no_token_allowed)] == reference
    assert any(len(t) > 1 for t in reference) and any(blocked for blocked in fast.no_token_allowed)
