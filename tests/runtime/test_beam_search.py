"""LLM.beam_search against a float64 reference beam search that expands every token of a 16-token
vocabulary with transformers' logits; width 1 is greedy decoding. Beams inside the engine share KV
blocks (ref counts, copy on write) and return what the prefix-cache implementation returns."""

import math

import pytest
import torch

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import RequestError
from llmc.runtime.beam_search import BeamSearchParams, beam_search_by_requests
from llmc.runtime.kv_cache import copy_blocks
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

VOCAB = 16
EOS = 1  # tests/conftest.py's eos id
PROMPTS = [[0, 5, 9, 3], [0, 7, 7, 2, 11, 6]]


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory, hf_checkpoint_factory):
    checkpoint = hf_checkpoint_factory(tmp_path_factory.mktemp("beam_ckpt"), "llama", seed=3, vocab_size=VOCAB)
    out = tmp_path_factory.mktemp("beam") / "model"
    build(recipe_from_dict({"model": str(checkpoint), "output": str(out), "dtype": "float32",
                            "runtime": {"max_model_len": 64}}), show_progress=False)
    return checkpoint, out


def _reference(checkpoint, hf_logits, prompt, width, steps, length_penalty, ignore_eos=True):
    """Beam search that scores every extension of every beam (float64 log-softmax of transformers' logits).
    Score: cumulative logprob / length ** length_penalty, the length counting the prompt and not a
    final eos (vLLM's get_beam_search_score, which discounts a final eos even with ignore_eos)."""
    eos = EOS
    live, done = [(list(prompt), 0.0)], []

    def score(beam):
        tokens, cum = beam
        length = len(tokens) - (1 if tokens[-1] == eos else 0)
        return cum / length ** length_penalty

    for _ in range(steps):
        candidates = []
        for tokens, cum in live:
            logprobs = torch.log_softmax(hf_logits(checkpoint, tokens)[-1].double(), dim=-1)
            for token in range(VOCAB):
                child = (tokens + [token], cum + float(logprobs[token]))
                (done if token == eos and not ignore_eos else candidates).append(child)
        live = sorted(candidates, key=score, reverse=True)[:width]
    return sorted(done + live, key=score, reverse=True)[:width]


def test_width_4_is_the_reference_beam_search(tiny_vocab, hf_logits):
    checkpoint, artifact = tiny_vocab
    with LLM(artifact, disable_log_stats=True) as llm:
        for length_penalty in (1.0, 0.5):
            params = BeamSearchParams(beam_width=4, max_tokens=3, ignore_eos=True, length_penalty=length_penalty)
            outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
            for prompt, output in zip(PROMPTS, outputs):
                expected = _reference(checkpoint, hf_logits, prompt, 4, 3, length_penalty)
                assert [s.tokens for s in output.sequences] == [tokens for tokens, _ in expected]
                for sequence, (_, cum) in zip(output.sequences, expected):
                    assert math.isclose(sequence.cum_logprob, cum, abs_tol=1e-4)
        # with eos: beams that end in eos are complete and compete with the others
        params = BeamSearchParams(beam_width=4, max_tokens=4, length_penalty=1.0)
        output = llm.beam_search({"prompt_token_ids": PROMPTS[1]}, params)[0]
        assert llm.engine.eos_token_ids == [EOS]
        expected = _reference(checkpoint, hf_logits, PROMPTS[1], 4, 4, 1.0, ignore_eos=False)
        assert [s.tokens for s in output.sequences] == [tokens for tokens, _ in expected]
        assert [s.finish_reason for s in output.sequences].count("stop") == sum(t[-1] == EOS for t, _ in expected) > 0


def test_width_1_is_greedy_and_bad_params_are_refused(tiny_vocab):
    _, artifact = tiny_vocab
    with LLM(artifact, disable_log_stats=True) as llm:
        for prompt in PROMPTS:
            greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
            beam = llm.beam_search([prompt], BeamSearchParams(beam_width=1, max_tokens=8, ignore_eos=True))[0]
            assert beam.sequences[0].tokens == prompt + greedy.outputs[0].token_ids
        with pytest.raises(RequestError, match="beam_width"):
            BeamSearchParams(beam_width=0, max_tokens=3)


def _run_beam_requests(llm, prompts, width, max_tokens):
    """Beam search requests stepped by hand: (outputs by prompt, the largest block ref count seen)."""
    engine = llm.engine
    params = SamplingParams(n=width, use_beam_search=True, max_tokens=max_tokens)
    ids = [engine.add_request(None, params, prompt) for prompt in prompts]
    finished, max_ref_count = {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            finished[output.request_id] = output
        max_ref_count = max(max_ref_count, max(block.ref_count for block in engine.scheduler.block_pool.blocks))
    return [finished[i] for i in ids], max_ref_count


@pytest.mark.parametrize("options", [
    {"num_kv_blocks": 64, "enable_prefix_caching": True},
    pytest.param({"num_kv_blocks": 64, "enable_prefix_caching": False}, marks=pytest.mark.slow),  # 3 s each
    # two searches that do not fit at once (seats and blocks): beams wait, are held and preempted
    pytest.param({"num_kv_blocks": 8, "max_num_seqs": 4, "max_model_len": 16, "enable_prefix_caching": False},
                 marks=pytest.mark.slow),
    {"num_kv_blocks": 8, "max_num_seqs": 8, "max_model_len": 16, "enable_prefix_caching": True},
])
def test_beams_share_kv_blocks_with_copy_on_write(tiny_vocab, options):
    """Forked beams hold the same blocks (ref count > 1), the first write into a shared last block
    copies it, the beams equal the prefix-cache implementation's, and every block is free after."""
    _, artifact = tiny_vocab
    width, max_tokens = 4, 6
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens)
    with LLM(artifact, disable_log_stats=True) as llm:
        expected = [beam_search_by_requests(llm, [p], params)[0] for p in PROMPTS]
    with LLM(artifact, disable_log_stats=True, block_size=8, **options) as llm:
        outputs, max_ref_count = _run_beam_requests(llm, PROMPTS, width, max_tokens)
        scheduler = llm.engine.scheduler
        assert max_ref_count > 1 and scheduler.num_block_copies > 0
        if options["num_kv_blocks"] == 8:
            assert scheduler.num_preemptions > 0
        for output, reference in zip(outputs, expected):
            assert [output.prompt_token_ids + c.token_ids for c in output.outputs] == [s.tokens for s in reference.sequences]
            assert [c.finish_reason for c in output.outputs] == [s.finish_reason for s in reference.sequences]
            for completion, sequence in zip(output.outputs, reference.sequences):
                assert math.isclose(completion.cumulative_logprob, sequence.cum_logprob, abs_tol=1e-4)
        assert scheduler.block_pool.num_free_blocks == scheduler.block_pool.num_blocks
        assert not scheduler.held and not scheduler.requests


def test_beam_search_requests_that_cannot_run_are_refused(tiny_vocab):
    _, artifact = tiny_vocab
    with LLM(artifact, disable_log_stats=True, block_size=8, num_kv_blocks=4, max_model_len=16, max_num_seqs=4) as llm:
        with pytest.raises(RequestError, match="max_num_seqs"):
            llm.generate([PROMPTS[0]], SamplingParams(n=5, use_beam_search=True, max_tokens=2))
        with pytest.raises(RequestError, match="KV blocks"):  # 4 beams of 2 blocks each: 8 > 4
            llm.generate([[0] * 9], SamplingParams(n=4, use_beam_search=True, max_tokens=6))
        fits = llm.generate([PROMPTS[0]], SamplingParams(n=4, use_beam_search=True, max_tokens=2))[0]  # 4 x 1 block
        assert len(fits.outputs) == 4
        with pytest.raises(RequestError, match="stop"):
            SamplingParams(n=2, use_beam_search=True, stop=["x"])
        pool = llm.engine.scheduler.block_pool
        assert pool.num_free_blocks == pool.num_blocks
    with LLM(artifact, disable_log_stats=True, max_logprobs=6) as llm:  # the fallback asks 2 x width logprobs
        with pytest.raises(RequestError, match=r"beam_width 4: .*more than its max_logprobs \(6\)"):
            beam_search_by_requests(llm, [PROMPTS[0]], BeamSearchParams(beam_width=4, max_tokens=2))
        assert len(beam_search_by_requests(llm, [PROMPTS[0]], BeamSearchParams(beam_width=3, max_tokens=2))[0].sequences) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_copy_blocks_copies_k_and_v_of_every_layer(dtype):
    caches = [(torch.randn(6, 8, 2, 4).to(dtype), torch.randn(6, 8, 2, 4).to(dtype)) for _ in range(2)]
    before = [(k.clone(), v.clone()) for k, v in caches]
    copy_blocks(caches, [(1, 4), (4, 0)])  # a source another pair writes is read before it is written
    for (k, v), (k0, v0) in zip(caches, before):
        for cache, old in ((k, k0), (v, v0)):
            assert torch.equal(cache[4].view(torch.uint8), old[1].view(torch.uint8))
            assert torch.equal(cache[0].view(torch.uint8), old[4].view(torch.uint8))
            assert torch.equal(cache[[1, 2, 3, 5]].view(torch.uint8), old[[1, 2, 3, 5]].view(torch.uint8))


def test_beam_searches_of_different_widths_share_a_step(tiny_vocab, hf_logits):
    """Two beam searches in one step ask for different numbers of logprobs (2 × width each), packed
    to the larger: each still gets the reference beams and scores (its smaller count once read the
    other's token ids as logprobs, and its beams went astray)."""
    checkpoint, artifact = tiny_vocab
    widths = (2, 4)
    params = [SamplingParams(n=w, use_beam_search=True, temperature=0, max_tokens=3, ignore_eos=True) for w in widths]
    with LLM(artifact, disable_log_stats=True) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, width, output in zip(PROMPTS, widths, outputs):
        expected = _reference(checkpoint, hf_logits, prompt, width, 3, 1.0)
        assert [list(prompt) + list(c.token_ids) for c in output.outputs] == [tokens for tokens, _ in expected]
        for completion, (_, cum) in zip(output.outputs, expected):
            assert math.isclose(completion.cumulative_logprob, cum, abs_tol=1e-4)


def test_both_searches_end_a_beam_at_max_model_len_beside_others_and_take_any_length_penalty(tiny_vocab):
    """A prompt whose beams reach max_model_len (64) ends them by length while another prompt's beams go
    on, in the engine's search and in the fallback (beam_search_by_requests, which dropped them when
    batched); a length_penalty whose length ** penalty leaves float range scores by its limit instead of
    failing the request (vLLM's expression overflows)."""
    from llmc.runtime.beam_group import beam_score

    _, artifact = tiny_vocab
    long = [0] + [2 + i % 13 for i in range(59)]  # 60 tokens: 4 to go
    params = BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True)
    with LLM(artifact, disable_log_stats=True) as llm:
        engine = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}, {"prompt_token_ids": long}], params)
        fallback = beam_search_by_requests(llm, [PROMPTS[0], long], params)
        for outputs in (engine, fallback):
            assert [len(o.sequences) for o in outputs] == [2, 2]
            assert all(len(s.tokens) == 64 and s.finish_reason == "length" for s in outputs[1].sequences)
            assert all(len(s.tokens) == len(PROMPTS[0]) + 8 for s in outputs[0].sequences)
        assert [s.tokens for s in fallback[1].sequences] == [s.tokens for s in engine[1].sequences]
        too_long = [0] + [2 + i % 13 for i in range(63)]  # 64 tokens: max_model_len, no room
        for search in (llm.beam_search, lambda prompts, p: beam_search_by_requests(llm, prompts, p)):
            with pytest.raises(RequestError, match="max_model_len"):
                search([{"prompt_token_ids": too_long}] if search is llm.beam_search else [too_long], params)
        for penalty in (1e308, 1000.0, -1000.0):
            outputs = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}],
                                      BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=penalty))
            assert len(outputs[0].sequences) == 2
    assert beam_score([1] * 8, -3.0, [], 1e308) == 0.0 and beam_score([1] * 8, -3.0, [], -1000.0) == -math.inf
