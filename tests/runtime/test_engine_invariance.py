"""Greedy outputs do not depend on how the engine schedules: cache size (preemption), token budget
(chunked prefill), prefix caching, speculation. Every block comes back to the pool afterwards."""

import random

import pytest

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import RequestError
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams

NUM_REQUESTS = 64
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, ref_model_dir):
    out = tmp_path_factory.mktemp("engine") / "ref"
    build(recipe_from_dict({"model": str(ref_model_dir), "output": str(out), "runtime": {"max_model_len": 256}}),
          show_progress=False)
    return out


@pytest.fixture(scope="module")
def prompts(artifact):
    """64 prompts: a few shared system prefixes (several blocks long) and user texts of mixed lengths."""
    rng = random.Random(0)
    words = ("the king", "my lord", "ROMEO:", "sweet love", "of the night", "and then", "I pray you", "good sir")
    prefixes = ["First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n",
                "You are a helpful assistant who answers in the manner of Shakespeare.\n",
                "The history of the county, as set down in the parish records, begins with "]
    return [rng.choice(prefixes) + " ".join(rng.choice(words) for _ in range(rng.randint(1, 20)))
            for _ in range(NUM_REQUESTS)]


def _generate(artifact, prompts, **options):
    llm = LLM(artifact, device="cpu", max_num_seqs=16, **options)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    stats = llm.stats()
    llm.engine.scheduler.check_invariants()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], "blocks leaked"
    assert llm.engine.scheduler.block_pool.num_free_blocks == stats["num_total_blocks"]
    return [o.outputs[0].token_ids for o in outputs], stats


@pytest.fixture(scope="module")
def reference(artifact, prompts):
    return _generate(artifact, prompts)


@pytest.mark.parametrize(
    ("options", "check"),
    [
        ({"num_kv_blocks": 24}, lambda s: s["num_preemptions"] > 0),
        ({"max_num_batched_tokens": 32}, None),
        ({"enable_prefix_caching": False}, lambda s: s["prefix_cache_hits"] == 0),
        ({"speculative": {"method": "ngram", "num_speculative_tokens": 3}}, lambda s: s["num_spec_proposed"] > 0),
        ({"num_kv_blocks": 24, "max_num_batched_tokens": 32, "speculative": {"method": "ngram", "num_speculative_tokens": 2}},
         lambda s: s["num_preemptions"] > 0),
    ],
    ids=["preemption", "budget-32", "no-prefix-cache", "ngram", "all-at-once"],
)
def test_greedy_outputs_identical(artifact, prompts, reference, options, check):
    expected, reference_stats = reference
    assert reference_stats["prefix_cache_hits"] > 0 and reference_stats["num_preemptions"] == 0
    got, stats = _generate(artifact, prompts, **options)
    mismatches = [i for i, (a, b) in enumerate(zip(expected, got)) if a != b]
    assert not mismatches, f"{len(mismatches)} requests differ, first {mismatches[0]}"
    if check is not None:
        assert check(stats), stats


def test_seeded_sampling_does_not_depend_on_the_batch(artifact, prompts):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234)
    llm = LLM(artifact, device="cpu")
    alone = llm.generate(prompts[0], params)[0].outputs[0].text
    crowd = llm.generate(prompts[:20], [params] + [SamplingParams(temperature=1.0, max_tokens=16)] * 19)
    assert crowd[0].outputs[0].text == alone
    other_seed = llm.generate(prompts[0], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=99))
    assert other_seed[0].outputs[0].text != alone


def test_seeded_samples_do_not_depend_on_speculation(artifact, prompts):
    """A seeded request draws the same numbers for its token number t whether or not n-gram speculation
    verified drafts at t (spec_decode's rejection sample and BatchSampler key them alike)."""
    params = [SamplingParams(temperature=1.0, max_tokens=24, seed=7 + i, ignore_eos=True) for i in range(6)]
    params.append(SamplingParams(temperature=0.8, top_p=0.9, n=2, max_tokens=24, seed=3, ignore_eos=True))
    chosen = ["First Citizen:", "ROMEO: ROMEO: ROMEO:", *prompts[:5]]
    plain = LLM(artifact, device="cpu", max_num_seqs=16).generate(chosen, params)
    spec_llm = LLM(artifact, device="cpu", max_num_seqs=16, speculative={"method": "ngram", "num_speculative_tokens": 3})
    spec = spec_llm.generate(chosen, params)
    assert spec_llm.stats()["num_spec_proposed"] > 0
    assert [[c.token_ids for c in o.outputs] for o in spec] == [[c.token_ids for c in o.outputs] for o in plain]


def test_request_that_can_never_fit_is_rejected_up_front(artifact):
    from llmc.errors import ConfigError, RequestError

    llm = LLM(artifact, device="cpu", max_model_len=32)
    with pytest.raises(RequestError, match="max_model_len is 32"):
        llm.generate(" ".join(["the king"] * 40), SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(ConfigError, match="fewer than max_model_len"):  # a cache too small for one sequence
        LLM(artifact, device="cpu", num_kv_blocks=4, max_model_len=256)


def test_queue_time_ends_when_the_first_step_starts_not_after_it(artifact):
    """RequestOutput.metrics' first_scheduled_time (the server's request_queue_time) is stamped before the
    forward: on an idle engine a long prompt waits ~0, while its prefill takes most of the time to its
    first output (it was stamped after the forward and sampling: queue time == the whole prefill)."""
    import time

    with LLM(artifact, device="cpu", disable_log_stats=True, max_num_batched_tokens=512) as llm:
        engine = llm.engine
        arrival = time.monotonic()
        engine.add_request(" ".join(["the king"] * 110), SamplingParams(temperature=0, max_tokens=1), arrival_time=arrival)
        while engine.has_unfinished_requests():
            outputs = engine.step()
        done = time.monotonic()
    queued = outputs[0].metrics["first_scheduled_time"] - arrival
    assert queued < 0.25 * (done - arrival), (queued, done - arrival)


def test_priority_policy_runs_urgent_requests_first(artifact, prompts):
    llm = LLM(artifact, device="cpu", scheduling_policy="priority", max_num_seqs=1)
    for i, priority in enumerate([5, 0, 3]):
        llm.engine.add_request(prompts[i], SamplingParams(temperature=0, max_tokens=2), request_id=str(i), priority=priority)
    order = []
    while llm.engine.has_unfinished_requests():
        order += [o.request_id for o in llm.engine.step() if o.finished]
    assert order == ["1", "2", "0"]  # priorities 0, 3, 5; one seat
    with LLM(artifact, device="cpu", disable_log_stats=True) as fcfs:  # vLLM refuses a priority it would ignore
        with pytest.raises(RequestError, match="priority 3: priority scheduling is not enabled"):
            fcfs.generate(prompts[:2], SamplingParams(max_tokens=1), priority=[0, 3])
        assert not fcfs.engine.has_unfinished_requests()
        assert fcfs.generate(prompts[:1], SamplingParams(max_tokens=1), priority=[0])[0].finished
