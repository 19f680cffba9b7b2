"""Fault injection: a request whose logits processor or detokenization raises, and a request
aborted (its client gone) during a chunked prefill, a speculative step and while preempted, each
end alone; the other requests finish with the outputs they get without the fault, and every KV
block and persistent-batch row comes back. (The suite runs with LLMC_CHECK_INVARIANTS=1: the
engine also checks its structures agree after every step.)"""

from __future__ import annotations

import pytest

from llmc.runtime.engine import Engine
from llmc.runtime.engine_faults import RequestFailedError, check_engine_invariants
from llmc.runtime.llm import LLM
from llmc.runtime.request import RequestStatus
from llmc.runtime.request_state import SequenceState
from llmc.runtime.sampling_params import SamplingParams

PROMPTS = ["the king and the queen", "ROMEO: my lord, I pray you", "of the night and then the day",
           "sweet love, sweet love, sweet love"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)


def _params(i: int) -> SamplingParams:
    return GREEDY if i % 2 == 0 else SEEDED


def _run(engine: Engine, requests: list[tuple[str, str, SamplingParams]], on_step=None) -> dict:
    """Add the requests, step to the end (calling on_step(engine) after each step); last outputs by id."""
    for request_id, prompt, params in requests:
        engine.add_request(prompt, params, request_id=request_id)
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            results[output.request_id] = output
        if on_step is not None:
            on_step(engine)
    return results


def _good() -> list[tuple[str, str, SamplingParams]]:
    return [(f"good{i}", prompt, _params(i)) for i, prompt in enumerate(PROMPTS)]


def _tokens(results: dict) -> dict:
    return {rid: [c.token_ids for c in out.outputs] for rid, out in results.items() if rid.startswith("good")}


def _assert_clean(engine: Engine) -> None:
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], "KV blocks leaked"
    assert sorted(engine._free_rows) == list(range(engine.options.max_num_seqs)), "batch rows leaked"
    assert not engine.groups and not engine.sequences and not engine.scheduler.requests
    check_engine_invariants(engine)


@pytest.fixture(scope="module")
def llm(server_artifact):
    with LLM(server_artifact, device="cpu", max_num_seqs=8, disable_log_stats=True) as llm:
        yield llm


@pytest.fixture(scope="module")
def reference(llm) -> dict:
    outputs = llm.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))])
    return {f"good{i}": [c.token_ids for c in out.outputs] for i, out in enumerate(outputs)}


def test_a_raising_logits_processor_fails_its_request_alone(llm, reference):
    calls = []

    def boom(output_ids, logits):
        calls.append(len(output_ids))
        if len(output_ids) == 3:
            raise ValueError("processor exploded")
        return logits

    bad = SamplingParams(temperature=0, max_tokens=12, logits_processors=[boom])
    with pytest.raises(RequestFailedError, match="processor exploded") as failure:
        llm.generate(PROMPTS[:2] + ["a bad one"] + PROMPTS[2:], [_params(0), _params(1), bad, _params(2), _params(3)])
    outputs = failure.value.outputs
    assert outputs[2].error is not None and outputs[2].finished and "ValueError" in outputs[2].error
    assert repr(outputs[2].request_id) in outputs[2].error  # names the request
    good = [outputs[i] for i in (0, 1, 3, 4)]
    assert all(o.error is None and o.finished for o in good)
    assert {f"good{i}": [c.token_ids for c in o.outputs] for i, o in enumerate(good)} == reference
    assert calls == [0, 1, 2, 3]  # ended at its fault: never called again
    _assert_clean(llm.engine)
    assert llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids == reference["good0"][0]  # still serving


@pytest.mark.parametrize("returned", ["a row of another shape", "not a tensor"])
def test_a_logits_processor_returning_a_wrong_row_fails_its_request_alone(llm, reference, returned):
    """A processor must return its row's logits; anything else (here from its third call) was a fault of the
    whole step, which failed every request of the batch."""
    def wrong(output_ids, logits):
        if len(output_ids) < 2:
            return logits
        return logits[:-1] if returned == "a row of another shape" else logits.tolist()

    bad = SamplingParams(temperature=0, max_tokens=12, logits_processors=[wrong])
    resets = llm.engine.num_resets
    with pytest.raises(RequestFailedError, match="a logits processor returned .* it must return the row's logits"):
        llm.generate(PROMPTS[:2] + ["a bad one"], [_params(0), _params(1), bad])
    assert llm.engine.num_resets == resets  # not a fault of the step
    _assert_clean(llm.engine)
    assert llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids == reference["good0"][0]


def test_a_raising_detokenization_fails_its_request_alone(llm, reference, monkeypatch):
    original = SequenceState.add_tokens

    def add_tokens(self, token_ids):
        if self.group_id == "bad" and self.request.num_output_tokens >= 4:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        original(self, token_ids)

    monkeypatch.setattr(SequenceState, "add_tokens", add_tokens)
    results = _run(llm.engine, _good() + [("bad", "the bad one, the bad one", SEEDED.replace(n=2))])
    assert results["bad"].finished and "UnicodeDecodeError" in results["bad"].error
    assert "'bad'" in results["bad"].error
    assert _tokens(results) == reference
    _assert_clean(llm.engine)


def test_a_raising_sampler_row_fails_its_request_alone(llm, reference, monkeypatch):
    """Sampling parameters that break the batched sampler when the request joins it."""
    sampler = llm.engine.sampler
    original = type(sampler).add

    def add(self, row, params, *rest):
        if params.min_tokens == 3:
            raise OverflowError("injected: a value the sampler cannot hold")
        original(self, row, params, *rest)

    monkeypatch.setattr(type(sampler), "add", add)
    results = _run(llm.engine, _good() + [("bad", "x", SamplingParams(min_tokens=3, max_tokens=5))])
    assert "OverflowError" in results["bad"].error
    assert _tokens(results) == reference
    _assert_clean(llm.engine)


def _abort_when(victim: str, condition):
    seen = []

    def on_step(engine: Engine) -> None:
        state = engine.sequences.get(f"{victim}#0")
        if state is not None and not seen and condition(state.request):
            seen.append(True)
            engine.abort_request(victim)
    return on_step, seen


@pytest.mark.parametrize("case", ["prefill", "speculative", "preempted"])
def test_a_client_gone_mid_flight_ends_alone(server_artifact, case):
    options = {
        "prefill": {"max_num_batched_tokens": 16},
        "speculative": {"speculative": {"method": "ngram", "num_speculative_tokens": 3}},
        "preempted": {"num_kv_blocks": 6, "max_model_len": 96, "max_num_batched_tokens": 64},
    }[case]
    long_prompt = " ".join(["the king and the queen of the night"] * 6)
    condition = {
        "prefill": lambda r: 0 < r.num_computed_tokens < r.num_prompt_tokens,
        "speculative": lambda r: r.num_output_tokens > 2 and bool(r.spec_token_ids),
        "preempted": lambda r: r.status is RequestStatus.WAITING and r.num_preemptions > 0,
    }[case]
    victim_params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    engine = Engine(server_artifact, device="cpu", max_num_seqs=8, disable_log_stats=True, **options)
    expected = _tokens(_run(engine, _good()))
    _assert_clean(engine)
    on_step, seen = _abort_when("victim", condition)
    results = _run(engine, _good() + [("victim", long_prompt, victim_params)], on_step)
    assert seen, f"the victim was never {case}"
    if case == "preempted":
        assert engine.stats()["num_preemptions"] > 0
    assert _tokens(results) == expected
    assert all(results[rid].finished for rid in expected)
    _assert_clean(engine)


def test_a_step_fault_no_request_caused_fails_all_and_resets(server_artifact, monkeypatch):
    engine = Engine(server_artifact, device="cpu", max_num_seqs=8, disable_log_stats=True)
    expected = _tokens(_run(engine, _good()))
    original, calls = engine.runner.execute, []

    def execute(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected device fault")
        return original(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", execute)
    results = _run(engine, _good())
    assert all(out.finished and "injected device fault" in out.error for out in results.values())
    assert engine.num_resets == 1
    _assert_clean(engine)
    assert _tokens(_run(engine, _good())) == expected  # serves again, identically


def test_a_dropped_stream_aborts_its_request(llm):
    stream = llm.stream("the king and the queen", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert next(stream)
    assert llm.engine.groups  # running
    del stream
    _assert_clean(llm.engine)
    never_started = llm.stream("the king", SamplingParams(temperature=0, max_tokens=40))
    assert llm.engine.groups
    del never_started
    _assert_clean(llm.engine)


def test_an_add_that_fails_part_way_leaves_nothing_behind(llm, reference, monkeypatch):
    """The reported wedge: n=3000000 ran out of memory after ~99k children were queued, and the
    scheduler kept sequences the engine had dropped. The add is all or none."""
    scheduler = llm.engine.scheduler
    original, added = type(scheduler).add_request, []

    def add_request(self, request):
        added.append(request.request_id)
        if len(added) == 3:
            raise MemoryError("injected: out of memory on the third sequence")
        original(self, request)

    monkeypatch.setattr(type(scheduler), "add_request", add_request)
    with pytest.raises(MemoryError):
        llm.engine.add_request("x", SamplingParams(n=5, temperature=1, max_tokens=4), request_id="huge")
    monkeypatch.undo()
    _assert_clean(llm.engine)
    assert _tokens(_run(llm.engine, _good())) == reference


def test_an_untokenizable_prompt_is_a_request_error(llm):
    from llmc.errors import RequestError

    with pytest.raises(RequestError, match="cannot be tokenized"):
        llm.generate(["the king", "\ud800"], GREEDY)  # all or none: the first is not left running
    _assert_clean(llm.engine)
