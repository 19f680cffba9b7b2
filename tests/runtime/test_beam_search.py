"""LLM.beam_search against a float64 reference beam search that expands every token of a 16-token
vocabulary with transformers' logits; width 1 is greedy decoding."""

import math

import pytest
import torch

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import RequestError
from llmc.runtime.beam_search import BeamSearchParams
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
