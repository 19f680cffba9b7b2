"""LLM lifecycle and concurrency: use after close, concurrent generate, an interrupted generate,
use_tqdm as a factory (vLLM's)."""

import threading

import pytest
from tqdm import tqdm

from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def artifact(ref_artifact_128):
    return ref_artifact_128


def test_use_after_close_raises(artifact):
    with LLM(artifact, device="cpu", disable_log_stats=True) as llm:
        llm.generate(["a"], GREEDY)
    for call in (lambda: llm.generate(["a"], GREEDY), lambda: llm.stream("a", GREEDY)):
        with pytest.raises(RuntimeError, match="closed"):
            call()


def test_interrupted_generate_leaves_nothing_behind(artifact):
    llm = LLM(artifact, device="cpu", disable_log_stats=True)
    reference = [o.outputs[0].token_ids for o in llm.generate(["a", "b"], GREEDY)]
    steps = 0
    step = llm.engine.step

    def interrupting_step():
        nonlocal steps
        steps += 1
        if steps == 3:
            raise KeyboardInterrupt
        return step()

    llm.engine.step = interrupting_step
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["x"] * 4, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    llm.engine.step = step
    assert not llm.engine.groups and not llm.engine.scheduler.requests
    assert [o.outputs[0].token_ids for o in llm.generate(["a", "b"], GREEDY)] == reference
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    llm.close()


def test_concurrent_generate_raises_clearly(artifact):
    llm = LLM(artifact, device="cpu", disable_log_stats=True)
    entered, release = threading.Event(), threading.Event()
    step = llm.engine.step

    def slow_step():
        entered.set()
        release.wait(10)
        return step()

    llm.engine.step = slow_step
    thread = threading.Thread(target=lambda: llm.generate(["a"], GREEDY))
    thread.start()
    assert entered.wait(10)
    with pytest.raises(RuntimeError, match="already running"):
        llm.generate(["b"], GREEDY)
    release.set()
    thread.join(10)
    llm.engine.step = step
    assert len(llm.generate(["b"], GREEDY)) == 1
    llm.close()


def test_use_tqdm_callable(artifact):
    calls = []

    def factory(*args, **kwargs):
        calls.append(kwargs)
        return tqdm(*args, **kwargs)

    with LLM(artifact, device="cpu", disable_log_stats=True) as llm:
        llm.generate(["a", "b"], GREEDY, use_tqdm=factory)
    assert len(calls) == 1 and calls[0]["total"] == 2


def test_streams_read_in_turns_and_a_generate_meanwhile_lose_no_text(artifact):
    """Each stream's text is its own whole completion whatever else steps the engine (other streams read in
    turns, a generate() between reads); the outputs those steps make for a stream are kept for it."""
    import itertools

    prompts = ["ROMEO:", "JULIET: I", "Once upon a time"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(artifact, device="cpu", disable_log_stats=True) as llm:
        expected = [o.outputs[0].text for o in llm.generate(prompts, params)]
        streams = [llm.stream(p, params) for p in prompts[:2]]
        texts = ["", ""]
        first = next(streams[1])  # the third prompt's generate runs while both streams are open
        texts[1] += first
        assert llm.generate(prompts[2:], params)[0].outputs[0].text == expected[2]
        for i in itertools.cycle(range(2)):
            piece = next(streams[i], None)
            if piece is None and all(s.request_id not in llm._stream_outputs for s in streams):
                break
            texts[i] += piece or ""
        assert texts == expected[:2]
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
