"""vLLM's prefix-cache controls: a request's `cache_salt` (its blocks shared only with requests of the same salt)
and `LLM.reset_prefix_cache()`, read off `num_cached_tokens` (prompt tokens served from the cache); salted and reset
runs give the tokens of an uncached run."""

import pytest

from llmc.errors import RequestError
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

PROMPT = "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun."
GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def llm(ref_artifact_128):
    with LLM(ref_artifact_128, device="cpu", block_size=16) as llm:
        yield llm


def _run(llm, **salt):
    output = llm.generate([{"prompt": PROMPT, **salt}], GREEDY)[0]
    return output.num_cached_tokens, output.outputs[0].token_ids


def test_cache_salt_separates_prefixes(llm):
    assert llm.reset_prefix_cache()
    num_tokens = len(llm.tokenizer.encode(PROMPT))
    full_blocks = (num_tokens - 1) // 16 * 16  # the last prompt token is always computed
    assert full_blocks >= 16
    cached, tokens = _run(llm)
    assert cached == 0
    assert _run(llm) == (full_blocks, tokens)
    assert _run(llm, cache_salt="tenant-a") == (0, tokens)  # the unsalted blocks are not its
    assert _run(llm, cache_salt="tenant-a") == (full_blocks, tokens)
    assert _run(llm, cache_salt="tenant-b") == (0, tokens)
    assert _run(llm) == (full_blocks, tokens)  # the unsalted ones are still there
    for salt in ("", 7):
        with pytest.raises(RequestError, match="^Parameter 'cache_salt' must be a non-empty string if provided.$"):
            llm.generate([{"prompt": PROMPT, "cache_salt": salt}], GREEDY)
    with pytest.raises(RequestError, match="cache_salt: use_beam_search does not run with a cache salt"):
        llm.generate([{"prompt": PROMPT, "cache_salt": "x"}],
                     SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=4))


def test_reset_prefix_cache(llm):
    _, tokens = _run(llm)
    assert _run(llm)[0] > 0
    assert llm.reset_prefix_cache()
    assert _run(llm) == (0, tokens)
    stream = llm.stream(PROMPT, SamplingParams(temperature=0, max_tokens=20))
    next(stream)  # its blocks are held while it is open
    assert not llm.reset_prefix_cache()
    stream.close()
    assert llm.reset_prefix_cache()
    with pytest.raises(RequestError, match="reset_running_requests: not supported"):
        llm.reset_prefix_cache(reset_running_requests=True)
