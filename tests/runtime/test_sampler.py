"""The batched sampler (runtime/batch_sampler.py) and the list-based processing the speculative
path uses (runtime/sampler.py): greedy, truncation, penalties, masks, seeds, distribution, logprobs."""

import math

import pytest
import torch

from llmc.runtime.batch_sampler import BatchSampler, unpack_logprobs
from llmc.runtime.sampler import (
    SamplingMetadata,
    compute_prompt_logprobs,
    probs_for,
    process_logits,
)
from llmc.runtime.sampling_params import SamplingParams

EOS = 0


def metadata(params, prompts=None, outputs=None, eos=(EOS,)) -> SamplingMetadata:
    """Metadata for `params` rows."""
    num_seqs = len(params)
    return SamplingMetadata(
        params=list(params),
        prompt_token_ids=prompts or [[] for _ in range(num_seqs)],
        output_token_ids=outputs or [[] for _ in range(num_seqs)],
        eos_token_ids=list(eos),
    )


def batch_sample(logits, params, prompts=None, outputs=None, sampler=None, seed=0):
    """One step of a BatchSampler whose row i holds params[i]: (token ids, logprob dicts or None)."""
    num_rows, vocab_size = logits.shape
    if sampler is None:
        sampler = BatchSampler(num_rows, vocab_size, torch.device("cpu"), [EOS], seed=seed)
        for row, p in enumerate(params):
            sampler.add(row, p, (prompts or [[]] * num_rows)[row], (outputs or [[]] * num_rows)[row])
    step = sampler.sample(logits, torch.arange(num_rows),
                          [(i, i, (prompts or [[]] * num_rows)[i], (outputs or [[]] * num_rows)[i])
                           for i, p in enumerate(params) if p.logits_processors])
    tokens = step.token_ids.tolist()
    if step.logprobs is None:
        return tokens, [None] * num_rows
    rows = step.logprobs.tolist()
    return tokens, [None if p.logprobs is None else unpack_logprobs(row, p.logprobs) for p, row in zip(params, rows)]


def random_logits(num_seqs: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_seqs, vocab_size, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_logits_are_not_modified():
    logits = random_logits(5, 100)
    before = logits.clone()
    tokens, logprobs = batch_sample(logits, [SamplingParams(temperature=0)] * 5)
    assert tokens == logits.argmax(dim=-1).tolist()
    assert torch.equal(logits, before)
    assert logprobs == [None] * 5


@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(top_p=1e-9),
                                    SamplingParams(min_p=1.0), SamplingParams(temperature=1e-6)])
def test_extreme_truncation_equals_greedy(params):
    logits = random_logits(8, 64, seed=1)
    assert batch_sample(logits, [params] * 8)[0] == logits.argmax(dim=-1).tolist()


def test_top_k_top_p_min_p_support_sets():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]] * 4))
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.8), SamplingParams(min_p=0.3),
              SamplingParams(top_k=-1, top_p=1.0, min_p=0.0)]
    probs = probs_for(logits, metadata(params))  # [4, 5]
    expected = torch.tensor([
        [0.4, 0.3, 0.0, 0.0, 0.0],      # two most likely
        [0.4, 0.3, 0.15, 0.0, 0.0],     # 0.4 + 0.3 < 0.8 <= 0.85
        [0.4, 0.3, 0.15, 0.0, 0.0],     # >= 0.3 * 0.4 = 0.12
        [0.4, 0.3, 0.15, 0.1, 0.05],    # nothing dropped
    ])
    expected /= expected.sum(dim=-1, keepdim=True)
    torch.testing.assert_close(probs, expected)


def test_min_p_cuts_before_top_p_as_vllm_v1_does():
    """vLLM v1 applies min_p (an argmax-invariant logits processor) after the temperature and before
    top-k/top-p, so top_p's nucleus is taken over what min_p kept: [0.30, 0.25, 0.25, 200 x 0.001]
    with min_p 0.01 keeps the three (0.375, 0.3125, 0.3125), and top_p 0.6 then the first two (v0's
    order, top_p first over the full distribution, kept the third as well)."""
    probs = torch.tensor([0.30, 0.25, 0.25] + [0.001] * 200)
    logits = torch.log(probs).repeat(2, 1)
    params = [SamplingParams(top_p=0.6, min_p=0.01), SamplingParams(top_p=0.6, min_p=0.01, top_k=50)]
    expected = torch.zeros_like(logits)
    expected[:, :2] = torch.tensor([0.30, 0.25]) / 0.55
    torch.testing.assert_close(probs_for(logits.clone(), metadata(params)), expected)
    seen = set()
    for seed in range(300):  # the batched sampler: only tokens 0 and 1
        seen.update(batch_sample(logits, [SamplingParams(top_p=0.6, min_p=0.01, seed=seed)] * 2)[0])
    assert seen == {0, 1}


def test_seeds_that_differ_mod_2_64_sample_differently_and_children_wrap():
    """Seeds run over [-2**63, 2**64), as torch.Generator.manual_seed takes them: 0 and 2**63 (equal
    in their low 63 bits) are different seeds, -7 and 2**64 - 7 the same one; the n sequences of
    seed 2**64 - 1 take 2**64 - 1 and then 0 (seed + i, wrapped), not an error."""
    from llmc.runtime.request_state import RequestGroup

    def samples(seed):
        return [batch_sample(random_logits(1, 1000, seed=i), [SamplingParams(seed=seed)])[0][0] for i in range(12)]

    assert samples(0) != samples(2**63) and samples(2**64 - 7) == samples(-7)
    group = RequestGroup.__new__(RequestGroup)
    group.params = SamplingParams(seed=2**64 - 1, n=2, temperature=1.0)
    assert [samples(p.seed) for p in group.child_params()] == [samples(2**64 - 1), samples(0)]


def test_temperature_scales_the_distribution():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    probs = probs_for(logits, metadata([SamplingParams(temperature=0.5)]))
    torch.testing.assert_close(probs, torch.softmax(logits / 0.5, dim=-1))


def test_penalties_match_hand_computation():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0, -2.0, 3.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    prompt, output = [1, 2], [2, 3, 3]
    processed = process_logits(logits.clone(), metadata([params], [prompt], [output]))
    # repetition: seen tokens {1, 2, 3}: positive / 2, negative * 2
    # frequency: 0.5 * count in output; presence: 0.25 if in output
    expected = torch.tensor([[
        2.0,                       # unseen
        -1.0 * 2.0,                # prompt only: repetition
        0.5 / 2.0 - 0.5 - 0.25,    # prompt and output once
        1.0 / 2.0 - 1.0 - 0.25,    # output twice
        -2.0,
        3.0,
    ]])
    torch.testing.assert_close(processed, expected)


def test_penalties_only_touch_their_rows():
    logits = random_logits(3, 10)
    params = [SamplingParams(), SamplingParams(presence_penalty=1.0), SamplingParams()]
    processed = process_logits(logits.clone(), metadata(params, outputs=[[1], [1, 2], [3]]))
    torch.testing.assert_close(processed[[0, 2]], logits[[0, 2]])
    torch.testing.assert_close(processed[1, [1, 2]], logits[1, [1, 2]] - 1.0)


def test_logit_bias_and_allowed_token_ids():
    logits = torch.zeros(3, 8)
    params = [SamplingParams(logit_bias={3: 5.0, 4: -2.0}),
              SamplingParams(allowed_token_ids=[2, 6]),
              SamplingParams(logit_bias={6: 1.0}, allowed_token_ids=[5, 6])]
    processed = process_logits(logits.clone(), metadata(params))
    assert processed[0, 3] == 5.0 and processed[0, 4] == -2.0 and processed[0, 0] == 0.0
    assert torch.isinf(processed[1]).sum() == 6 and processed[1, [2, 6]].tolist() == [0.0, 0.0]
    assert processed[2, 5] == 0.0 and processed[2, 6] == 1.0
    assert torch.isinf(processed[2]).sum() == 6
    batch = logits.repeat(20, 1)  # [60, 8]
    sampled = batch_sample(batch, params * 20)[0]
    assert set(sampled[1::3]) <= {2, 6} and set(sampled[2::3]) <= {5, 6}


def test_min_tokens_masks_eos_and_stop_tokens():
    logits = torch.zeros(4, 6)
    logits[:, EOS] = logits[:, 5] = 50.0  # eos and the stop token dominate
    params = [SamplingParams(min_tokens=2, stop_token_ids=[5]),
              SamplingParams(min_tokens=2, stop_token_ids=[5]),
              SamplingParams(min_tokens=2, ignore_eos=True),
              SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5])]
    outputs = [[3], [3, 4], [3], [1, 2]]
    processed = process_logits(logits.clone(), metadata(params, outputs=outputs))
    assert torch.isinf(processed[0, [EOS, 5]]).all()  # 1 output < 2: masked
    assert not torch.isinf(processed[1]).any()  # 2 outputs: min_tokens met
    assert not torch.isinf(processed[2]).any()  # ignore_eos: eos is no stop token
    sampled = batch_sample(logits, params, outputs=outputs)[0]
    assert sampled[0] not in (EOS, 5) and sampled[3] not in (EOS, 5)


def test_logits_processors_two_and_three_arguments():
    seen = {}

    def ban_last(output_ids, logits):
        logits[output_ids[-1]] = float("-inf")
        return logits

    def prefer_prompt_start(prompt_ids, output_ids, logits):
        seen["args"] = (list(prompt_ids), list(output_ids))
        boosted = logits.clone()
        boosted[prompt_ids[0]] += 100.0
        return boosted

    logits = torch.zeros(2, 10)
    logits[:, 7] = 10.0
    params = [SamplingParams(temperature=0, logits_processors=[ban_last]),
              SamplingParams(temperature=0, logits_processors=[prefer_prompt_start])]
    tokens, _ = batch_sample(logits, params, prompts=[[1], [4, 5]], outputs=[[7], [2]])
    assert tokens[1] == 4 and tokens[0] != 7
    assert seen["args"] == ([4, 5], [2])


def test_seeded_rows_reproducible_whatever_the_batch():
    logits = random_logits(1, 50, seed=3)

    def run(batch_seeds, position, num_steps=12):
        """Tokens of the row at `position` over several steps of a batch with `batch_seeds`."""
        params = [SamplingParams(seed=s) for s in batch_seeds]
        sampler = BatchSampler(len(params), logits.shape[1], torch.device("cpu"), [EOS], seed=len(batch_seeds))
        for row, p in enumerate(params):
            sampler.add(row, p, [], [])
        batch = logits.expand(len(params), -1)
        return [batch_sample(batch, params, sampler=sampler)[0][position] for _ in range(num_steps)]

    alone = run([42], 0)
    assert run([None, 42, 7], 1) == alone
    assert run([7, None, None, 42], 3) == alone
    assert run([43], 0) != alone


def test_rows_joining_and_leaving_sample_as_a_fresh_batch():
    """Rows come and go with every kind of parameter (the summary and the sparse lists follow them
    as they change); at checkpoints along the way the active rows sample, token for token and
    logprob for logprob, as a fresh sampler given only them does, down to a batch of plain greedy
    rows, which take the argmax of their raw logits."""
    import random

    vocab_size, num_rows = 40, 12
    greedy = SamplingParams(temperature=0)
    kinds = [greedy, SamplingParams(seed=1, top_k=5), SamplingParams(seed=2, top_p=0.7),
             SamplingParams(seed=3, min_p=0.2, logprobs=2), SamplingParams(temperature=0, logit_bias={7: 30.0}),
             SamplingParams(seed=4, allowed_token_ids=[3, 9, 11]),
             SamplingParams(seed=5, temperature=0.5, presence_penalty=2.0),
             SamplingParams(temperature=0, min_tokens=5, stop_token_ids=[9]), SamplingParams(seed=6, logprobs=4)]
    rng = random.Random(0)
    churned = BatchSampler(num_rows, vocab_size, torch.device("cpu"), [EOS], seed=1)
    active = {}  # row -> (params, banned ids)

    def join(row, params, banned):
        active[row] = (params, banned)
        churned.add(row, params, [1, 2], [4], banned_token_ids=banned)

    def compare(seed):
        rows = sorted(active)
        fresh = BatchSampler(num_rows, vocab_size, torch.device("cpu"), [EOS], seed=1)
        for row in rows:
            fresh.add(row, active[row][0], [1, 2], [4], banned_token_ids=active[row][1])
        assert churned.is_plain_greedy() == fresh.is_plain_greedy()  # (both refresh their device copies)
        # the steps in between advanced the device-side counts of the rows they sampled: start both alike
        churned.num_output.copy_(fresh.num_output)
        if fresh.output_counts is not None:
            churned.output_counts.copy_(fresh.output_counts)
        logits = random_logits(len(rows), vocab_size, seed=seed)
        first, second = (s.sample(logits.clone(), torch.tensor(rows)) for s in (churned, fresh))
        assert torch.equal(first.token_ids, second.token_ids) and first.num_top == second.num_top
        assert (first.logprobs is None) == (second.logprobs is None)
        assert first.logprobs is None or torch.equal(first.logprobs, second.logprobs)
        for i, row in enumerate(rows):
            assert int(first.token_ids[i]) not in active[row][1]
        return logits, first

    for step in range(400):
        row = rng.randrange(num_rows)
        if row in active and rng.random() < 0.5:
            churned.remove(row)
            del active[row]
        else:  # join, or new parameters for a row that holds some (no remove in between)
            join(row, kinds[rng.randrange(len(kinds))], rng.sample(range(1, vocab_size), rng.randrange(3)))
        if rng.random() < 0.2:  # steps in between, as the engine samples while rows change
            churned.sample(random_logits(num_rows, vocab_size, seed=rng.randrange(100)), torch.arange(num_rows))
        if step % 40 == 39 and active:
            compare(step)
    for row in list(active):  # down to plain greedy rows: one given new parameters, the others leave
        if row % 3 == 0:
            join(row, greedy, [])
        else:
            churned.remove(row)
            del active[row]
    logits, sampled = compare(0)
    assert churned.is_plain_greedy() and sampled.logprobs is None
    assert torch.equal(sampled.token_ids, logits.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_logits_sample_as_their_float32_values(dtype):
    """A GPU runner hands the sampler the head's bf16/fp16 logits: every kind of row (plain greedy
    alone, where the argmax reads them as they are, and mixed with sampled, penalized, biased and
    logprob rows) gets the tokens and logprobs it gets from the same values in float32. Rounding to
    16 bits makes ties, which the argmax breaks to the first, as on float32."""
    vocab_size = 300
    kinds = [SamplingParams(temperature=0), SamplingParams(seed=1, top_k=5), SamplingParams(seed=2, top_p=0.7),
             SamplingParams(seed=3, min_p=0.2, logprobs=2), SamplingParams(temperature=0, logit_bias={7: 3.0}),
             SamplingParams(seed=5, temperature=0.5, presence_penalty=2.0, repetition_penalty=1.3),
             SamplingParams(seed=6, logprobs=4)]
    for batch in ([kinds[0]] * 6, kinds * 2):
        logits = (random_logits(len(batch), vocab_size, seed=len(batch)) * 4).to(dtype)
        assert any(len(set(row.tolist())) < vocab_size for row in logits)  # ties exist
        runs = []
        for values in (logits, logits.float()):
            sampler = BatchSampler(len(batch), vocab_size, torch.device("cpu"), [EOS], seed=9)
            for row, p in enumerate(batch):
                sampler.add(row, p, [1, 2], [4, 7])
            runs.append([sampler.sample(values, torch.arange(len(batch))) for _ in range(3)])
        for first, second in zip(*runs):
            assert torch.equal(first.token_ids, second.token_ids)
            assert (first.logprobs is None) == (second.logprobs is None)
            assert first.logprobs is None or torch.equal(first.logprobs, second.logprobs)
        if all(p is kinds[0] for p in batch):
            assert torch.equal(runs[0][0].token_ids, logits.float().argmax(dim=-1))


def test_unseeded_sampling_matches_softmax():
    vocab_logits = torch.tensor([0.5, -1.0, 1.5, 0.0, 1.0, -0.5])
    temperature, num_samples = 0.8, 20000
    logits = vocab_logits.expand(num_samples, -1)
    params = [SamplingParams(temperature=temperature)] * num_samples
    sampled = batch_sample(logits, params, seed=123)[0]
    counts = torch.bincount(torch.tensor(sampled), minlength=6).double()
    expected = torch.softmax(vocab_logits.double() / temperature, dim=-1) * num_samples
    chi_square = ((counts - expected) ** 2 / expected).sum().item()
    assert chi_square < 20.5  # 5 degrees of freedom, p = 0.001


def test_logprobs_are_raw_log_softmax_with_ranks():
    logits = random_logits(3, 40, seed=5)
    params = [SamplingParams(logprobs=3, temperature=0.5, presence_penalty=1.0),
              SamplingParams(),
              SamplingParams(logprobs=0, temperature=0)]
    tokens, logprobs = batch_sample(logits, params, outputs=[[1], [], []])
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert logprobs[1] is None
    for row in (0, 2):
        sampled = tokens[row]
        assert next(iter(logprobs[row])) == sampled  # the sampled token comes first
        for token_id, value in logprobs[row].items():
            assert math.isclose(value, reference[row, token_id].item(), abs_tol=1e-5)
    top3 = reference[0].topk(3).indices.tolist()
    assert list(logprobs[0])[-3:] == top3 or set(logprobs[0]) == set(top3) | {tokens[0]}
    assert list(logprobs[2]) == [tokens[2]]


def test_rows_asking_fewer_logprobs_than_the_step_packs_get_their_own():
    """A step packs every row's top entries to the largest count asked; a row that asked fewer gets its
    own top-k with their values (it once read the wider rows' token ids as logprobs)."""
    logits = random_logits(4, 40, seed=11)
    counts = [1, 2, 5, 0]
    tokens, logprobs = batch_sample(logits, [SamplingParams(logprobs=k, temperature=0) for k in counts])
    reference = torch.log_softmax(logits.double(), dim=-1)
    for row, count in enumerate(counts):
        top = reference[row].topk(count).indices.tolist() if count else []
        assert set(logprobs[row]) == set(top) | {tokens[row]}
        for token_id, value in logprobs[row].items():
            assert math.isclose(value, reference[row, token_id].item(), abs_tol=1e-5)


def test_packed_ranks_count_more_likely_tokens():
    logits = random_logits(4, 40, seed=9)
    sampler = BatchSampler(4, 40, torch.device("cpu"), [EOS])
    for row in range(4):
        sampler.add(row, SamplingParams(logprobs=2, temperature=1.0), [], [])
    step = sampler.sample(logits, torch.arange(4))
    reference = torch.log_softmax(logits.double(), dim=-1)
    for row, packed in enumerate(step.logprobs.tolist()):
        token = int(packed[0])
        assert packed[2] == int((reference[row] > reference[row, token]).sum()) + 1  # rank, 1 = most likely


def test_compute_prompt_logprobs():
    logits = random_logits(4, 30, seed=7)  # [num_prompt_tokens, vocab_size]
    next_ids = [3, 9, 0, 29]
    result = compute_prompt_logprobs(logits, next_ids, num_top=2)
    reference = torch.log_softmax(logits, dim=-1)
    assert len(result) == 4
    for row, (token_id, logprobs) in enumerate(zip(next_ids, result)):
        assert token_id in logprobs and len(logprobs) in (2, 3)
        for t, value in logprobs.items():
            assert math.isclose(value, reference[row, t].item(), abs_tol=1e-5)


def test_probs_for_greedy_rows_are_one_hot():
    logits = random_logits(3, 16, seed=8)
    params = [SamplingParams(temperature=0), SamplingParams(top_k=4), SamplingParams()]
    probs = probs_for(logits, metadata(params))
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(3))
    assert probs[0, logits[0].argmax()] == 1.0
    assert (probs[1] > 0).sum() == 4
    torch.testing.assert_close(probs[2], torch.softmax(logits[2], dim=-1))


