"""Overlapped scheduling (async_scheduling) changes when the host learns each token, never which
token: the overlapped and the synchronous engine give identical greedy and seeded outputs over mixed
workloads (chunked prefill, preemption with a tiny cache, aborts mid-stream, stop strings, n=2,
penalties, logit bias, logprobs, min_tokens), and every KV block comes back; and, in the same random
workloads, a greedy or seeded request gets what it gets alone."""

import random

import pytest
import torch

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.runtime.engine import Engine
from llmc.runtime.sampling_params import RequestOutputKind, SamplingParams
from llmc.runtime.structured_output import StructuredOutputsParams

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, ref_model_dir):
    out = tmp_path_factory.mktemp("overlap") / "ref"
    build(recipe_from_dict({"model": str(ref_model_dir), "output": str(out), "dtype": "float32",
                            "runtime": {"max_model_len": 192}}), show_progress=False)
    return out


WORDS = ("the king", "my lord", "ROMEO:", "sweet love", "of the night", "and then", "I pray you")


def _kinds() -> list[SamplingParams]:
    """Every kind of sampling the engine batches."""
    return [
        SamplingParams(temperature=0, max_tokens=20),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=18),
        SamplingParams(temperature=1.0, top_k=5, seed=12, max_tokens=16, n=2),
        SamplingParams(temperature=0, max_tokens=24, stop=["\n\n", " the"]),
        SamplingParams(temperature=0.8, seed=13, max_tokens=16, repetition_penalty=1.3, frequency_penalty=0.4,
                       presence_penalty=0.2),
        SamplingParams(temperature=0, max_tokens=12, logit_bias={5: 4.0, 9: -100.0}, min_tokens=6),
        SamplingParams(temperature=0.7, min_p=0.05, seed=14, max_tokens=14, logprobs=2),
        SamplingParams(temperature=0.6, seed=15, max_tokens=10, best_of=3, n=1),
    ]


def _workload(seed: int = 0) -> list[tuple[str, SamplingParams]]:
    """Prompts of mixed lengths, each kind of sampling in turn."""
    rng, kinds = random.Random(seed), _kinds()
    return [(" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40))), kinds[i % len(kinds)])
            for i in range(24)]


def _run(artifact, device: str, abort_after: dict[str, int] | None = None,
         arrivals: dict[int, list[tuple[str, str, SamplingParams]]] | None = None, **options) -> tuple[dict, Engine]:
    """Drive an Engine by hand, adding arrivals[k] (request id, prompt, params) before step k (default:
    _workload() before the first), aborting request r once it has delivered abort_after[r] tokens (the
    overlapped engine has one more step in flight then); its last outputs, by request id."""
    if device == "cuda":  # two engines live at once in a test: a fixed cache, not 90% of the GPU each
        options = {"num_kv_blocks": 256, **options}
    engine = Engine(artifact, device=device, disable_log_stats=True, **{"max_num_seqs": 8, **options})
    if arrivals is None:
        arrivals = {0: [(f"r{i}", prompt, params) for i, (prompt, params) in enumerate(_workload())]}
    arrivals, results, step = dict(arrivals), {}, 0
    while engine.has_unfinished_requests() or arrivals:
        for request_id, prompt, params in arrivals.pop(step, []):
            engine.add_request(prompt, params, request_id=request_id)
        for output in engine.step():
            results[output.request_id] = output
        for request_id, num_tokens in (abort_after or {}).items():
            delivered = results[request_id].outputs[0].token_ids if request_id in results else []
            if len(delivered) >= num_tokens and request_id in engine.groups:
                engine.abort_request(request_id)
        engine.scheduler.check_invariants()
        step += 1
    return results, engine


def _summary(results: dict) -> dict:
    return {rid: [(c.token_ids, c.text, c.finish_reason, None if c.logprobs is None else
                   [sorted(lp.items()) for lp in c.logprobs]) for c in out.outputs]
            for rid, out in sorted(results.items())}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", [  # plain with -m slow (the default run's time, session 42)
    pytest.param({}, id="plain", marks=pytest.mark.slow),
    pytest.param({"max_num_batched_tokens": 24}, id="chunked"),  # prefill chunks
    pytest.param({"num_kv_blocks": 14, "max_num_batched_tokens": 48}, id="preemption"),  # preemption by recompute
])
def test_overlapped_equals_synchronous(artifact, device, options, free_gpu):
    aborts = {"r3": 1, "r9": 5}  # right after its first token, and mid-stream (n=1: a sibling of n=2 runs on)
    sync, sync_engine = _run(artifact, device, aborts, async_scheduling=False, **options)
    overlapped, engine = _run(artifact, device, aborts, **options)
    assert engine._can_overlap and not sync_engine._can_overlap
    got, expected = _summary(overlapped), _summary(sync)
    assert {r: [c[:3] for c in o] for r, o in got.items()} == {r: [c[:3] for c in o] for r, o in expected.items()}
    for request_id, completions in got.items():  # logprobs: equal up to float32 batch-order noise
        for (*_, logprobs), (*_, reference) in zip(completions, expected[request_id]):
            assert (logprobs is None) == (reference is None)
            for step, step_ref in zip(logprobs or [], reference or []):
                assert [t for t, _ in step] == [t for t, _ in step_ref]
                assert max(abs(v - w) for (_, v), (_, w) in zip(step, step_ref)) < 1e-3
    finished = [out for rid, out in overlapped.items() if rid not in aborts]
    assert len(finished) == 22 and all(out.finished for out in finished)
    if "num_kv_blocks" in options:
        assert engine.stats()["num_preemptions"] > 0
    for e in (engine, sync_engine):
        stats = e.stats()
        assert stats["num_free_blocks"] == stats["num_total_blocks"], "KV blocks leaked"
        assert sorted(e._free_rows) == list(range(8)), "persistent-batch rows leaked"


def _staggered_run(artifact, seed: int, async_scheduling: bool, **options) -> dict:
    """A random workload whose requests arrive over the first steps (so they join while a step is in
    flight), some sharing prompt prefixes, a few aborted after a random number of tokens: the
    outputs of the requests not aborted, by request id."""
    rng = random.Random(seed)
    kinds = _kinds() + [SamplingParams(temperature=0, max_tokens=rng.randint(1, 25)),
                        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                        SamplingParams(temperature=0.5, seed=16, max_tokens=9, n=3)]
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40))) for _ in range(6)]
    arrivals: dict[int, list] = {}
    num_requests = rng.randint(10, 30)
    for i in range(num_requests):
        prompt = rng.choice(prefixes) + (" " + rng.choice(WORDS) if rng.random() < 0.5 else "")
        arrivals.setdefault(rng.randint(0, 10), []).append((f"r{i}", prompt, rng.choice(kinds)))
    aborts = {f"r{rng.randrange(num_requests)}": rng.randint(0, 6) for _ in range(rng.randint(0, 3))}
    results, engine = _run(artifact, "cpu", aborts, arrivals, async_scheduling=async_scheduling, **options)
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], "KV blocks leaked"
    assert len(engine._free_rows) == engine.options.max_num_seqs, "persistent-batch rows leaked"
    return {rid: [(c.token_ids, c.text, c.finish_reason) for c in out.outputs]
            for rid, out in sorted(results.items()) if rid not in aborts}


# seed 1: the same options on another arrival pattern, 5-9 s each on 2 cores: with -m slow
@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])
@pytest.mark.parametrize("options", [  # plain and three-rows with -m slow too (the default run's time, session 42)
    pytest.param({}, id="plain", marks=pytest.mark.slow),
    pytest.param({"max_num_batched_tokens": 24}, id="chunked"),
    pytest.param({"num_kv_blocks": 14, "max_num_batched_tokens": 48}, id="preemption"),
    pytest.param({"enable_prefix_caching": True, "max_num_batched_tokens": 32}, id="prefix-cache", marks=pytest.mark.slow),
    pytest.param({"max_num_seqs": 3}, id="three-rows", marks=pytest.mark.slow),
])
def test_overlapped_equals_synchronous_as_requests_arrive(artifact, seed, options):
    """Requests joining while a step is in flight (the overlapped engine has scheduled the next step
    before it learns the tokens of this one) get the synchronous engine's outputs too."""
    overlapped = _staggered_run(artifact, seed, True, **options)
    assert overlapped == _staggered_run(artifact, seed, False, **options)


def _random_params(rng: random.Random) -> SamplingParams:
    """Any mix of the fields the batched sampler and the stop checks handle, in any output kind."""
    kw = {"max_tokens": rng.randint(1, 30), "output_kind": rng.choice(list(RequestOutputKind))}
    if rng.random() < 0.6:
        kw |= {"temperature": rng.choice([0.5, 1.0, 1.3]), "seed": rng.randrange(1000)}
        for name, values, chance in [("top_p", [0.5, 0.9], 0.4), ("top_k", [1, 5, 40], 0.4), ("min_p", [0.02, 0.1], 0.3)]:
            if rng.random() < chance:
                kw[name] = rng.choice(values)
        if rng.random() < 0.3:
            kw["n"] = rng.choice([2, 3])
            if rng.random() < 0.3 and kw["output_kind"] is not RequestOutputKind.DELTA:
                kw["best_of"] = kw["n"] + 1
    else:
        kw["temperature"] = 0.0
    for name, values, chance in [
        ("presence_penalty", [0.3, -0.5, 1.0], 0.3), ("frequency_penalty", [0.3, 0.8], 0.3),
        ("repetition_penalty", [1.2, 0.9], 0.3), ("stop", [["\n"], [" the", "lord"], [",", "ing"]], 0.3),
        ("include_stop_str_in_output", [True], 0.2), ("ignore_eos", [True], 0.2), ("logprobs", [0, 1, 3], 0.3),
        ("bad_words", [["the", "lord"]], 0.1), ("prompt_logprobs", [0, 2], 0.1),
    ]:
        if rng.random() < chance:
            kw[name] = rng.choice(values)
    if rng.random() < 0.3:
        kw["stop_token_ids"] = [rng.randrange(2000) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.3:
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
    if rng.random() < 0.2:
        kw["logit_bias"] = {rng.randrange(2000): rng.choice([-100.0, 5.0, 2.0]) for _ in range(3)}
    if rng.random() < 0.1:
        kw["allowed_token_ids"] = [rng.randrange(2000) for _ in range(50)]
    elif rng.random() < 0.1:
        kw["structured_outputs"] = StructuredOutputsParams(regex=rng.choice(["[a-z ]{4,12}", "(yes|no), my lord"]))
    return SamplingParams(**kw)


def _random_run(artifact, seed: int, async_scheduling: bool, options: dict) -> dict:
    """A random workload of random parameters arriving over the first steps, a few aborted: what each
    request not aborted was given: its last output (cumulative, final-only: and how many outputs)
    or its deltas joined per sequence."""
    rng = random.Random(seed)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))) for _ in range(5)]
    requests = [(f"r{i}", rng.choice(prefixes) + (" " + rng.choice(WORDS) if rng.random() < 0.5 else ""),
                 _random_params(rng), rng.randint(0, 12)) for i in range(rng.randint(5, 25))]
    aborts = {f"r{rng.randrange(len(requests))}": rng.randint(0, 6) for _ in range(rng.randint(0, 3))}
    engine = Engine(artifact, device="cpu", disable_log_stats=True, async_scheduling=async_scheduling,
                    **{"max_num_seqs": 8, **options})
    outputs: dict[str, list] = {}
    step = 0
    while engine.has_unfinished_requests() or step <= 12:
        for request_id, prompt, params, arrival in requests:
            if arrival == step:
                engine.add_request(prompt, params, request_id=request_id)
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
        for request_id, num_outputs in aborts.items():
            if len(outputs.get(request_id, [])) >= num_outputs and request_id in engine.groups:
                engine.abort_request(request_id)
        step += 1
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], "KV blocks leaked"
    assert len(engine._free_rows) == engine.options.max_num_seqs, "persistent-batch rows leaked"
    summary = {}
    for request_id, _, params, _ in requests:
        if request_id in aborts:
            continue
        got, last = outputs[request_id], outputs[request_id][-1]
        assert last.finished
        if params.output_kind is RequestOutputKind.DELTA:
            joined: dict[int, tuple] = {}  # index -> (token ids, text, its last delta's finish reason)
            for output in got:
                for c in output.outputs:
                    ids, text, _ = joined.get(c.index, ((), "", None))
                    joined[c.index] = (ids + tuple(c.token_ids), text + c.text, c.finish_reason)
            summary[request_id] = sorted(joined.items())
        else:
            if params.output_kind is RequestOutputKind.FINAL_ONLY:
                assert len(got) == 1
            summary[request_id] = [(c.token_ids, c.text, c.finish_reason) for c in last.outputs]
    return summary


@pytest.mark.parametrize("seed,options", [  # plain with -m slow (the default run's time, session 42)
    pytest.param(0, {}, marks=pytest.mark.slow),
    (1, {"num_kv_blocks": 14, "max_num_batched_tokens": 48}),
    (2, {"enable_prefix_caching": True, "max_num_batched_tokens": 32}),
    (3, {"num_kv_blocks": 20, "max_num_batched_tokens": 32, "enable_prefix_caching": True,
         "speculative": {"method": "ngram", "num_speculative_tokens": 2}}),
], ids=["plain", "preemption", "prefix-cache", "ngram"])
def test_overlapped_equals_synchronous_over_random_parameters(artifact, seed, options):
    """Random mixes of every sampling and stopping field, in every output kind (a DELTA stream
    joined per sequence: the overlapped engine may hand a sibling's delta out a step later), give the
    synchronous engine's outputs."""
    assert _random_run(artifact, seed, True, options) == _random_run(artifact, seed, False, options)


@pytest.mark.gpu
def test_launching_a_step_never_waits_for_the_device(artifact, free_gpu):
    """Scheduling and launching a step (inputs, forward, sampling, rows joining) never synchronizes
    the stream, prefill and mixed steps included: torch's sync debug mode raises on a blocking copy
    or a stream sync. Each tensor made from host data in a kernel call (torch.tensor(list,
    device="cuda")) waited for the step in flight before it, and the host could not run ahead."""
    engine = Engine(artifact, device="cuda", max_num_seqs=8, num_kv_blocks=256, max_num_batched_tokens=48,
                    disable_log_stats=True)
    launch, num_launches = engine._launch, 0

    def strict_launch(batch):
        nonlocal num_launches
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            num_launches += 1

    engine._launch = strict_launch
    plain = [(prompt, params) for prompt, params in _workload(1) if not params.logits_processors]
    for i, (prompt, params) in enumerate(plain):
        engine.add_request(prompt, params, request_id=f"r{i}")
    errors = []
    while engine.has_unfinished_requests():
        errors += [o.error for o in engine.step() if o.error is not None]  # a sync fails the step's requests
    assert not errors, errors[0]
    assert num_launches > len(plain) and engine.num_resets == 0


def test_overlap_keeps_one_step_in_flight(artifact):
    """The overlapped engine returns step N-1's outputs from step(): the first call launches only."""
    engine = Engine(artifact, device="cpu", max_num_seqs=4, disable_log_stats=True)
    engine.add_request("ROMEO:", SamplingParams(temperature=0, max_tokens=3))
    assert engine.step() == []  # the prefill is launched; its token is still pending
    request = engine.scheduler.running[0]
    assert request.num_pending_tokens == 1 and request.output_token_ids == []
    outputs = engine.step()  # launches the first decode, resolves the prefill's token
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1] and request.num_pending_tokens == 1
    while engine.has_unfinished_requests():
        outputs = engine.step()
    assert outputs[0].finished and len(outputs[0].outputs[0].token_ids) == 3


def test_seeded_samples_do_not_depend_on_the_batch(artifact):
    """A seeded request's tokens are the same alone and among others (counter-based randomness)."""
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=16)
    alone, _ = _run_one(artifact, [("JULIET:", params)])
    others = [(f"prompt {i} of the night", SamplingParams(temperature=1.0, max_tokens=8 + i)) for i in range(6)]
    crowded, _ = _run_one(artifact, others[:3] + [("JULIET:", params)] + others[3:])
    assert crowded[3] == alone[0]
    reseeded, _ = _run_one(artifact, [("JULIET:", SamplingParams(temperature=1.0, seed=1235, max_tokens=16))])
    assert reseeded[0] != alone[0]


def _run_one(artifact, requests):
    engine = Engine(artifact, device="cpu", max_num_seqs=8, disable_log_stats=True)
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            results[output.request_id] = output.outputs[0].token_ids
    return [results[i] for i in ids], engine


def test_pending_tokens_feed_the_next_step_on_the_device(artifact):
    """Greedy through the overlapped engine equals the model's argmax chain recomputed from scratch
    by score() for every prefix: each placeholder was filled on the device with the right token id."""
    engine = Engine(artifact, device="cpu", max_num_seqs=4, disable_log_stats=True)
    prompt = engine.tokenizer.encode("First Citizen:")
    engine.add_request(None, SamplingParams(temperature=0, max_tokens=8), prompt_token_ids=prompt)
    tokens = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens = output.outputs[0].token_ids
    expected = list(prompt)
    for _ in range(8):
        expected.append(int(engine.score(expected)[-1].argmax()))
    assert tokens == expected[len(prompt):]


def test_loaded_engine_freezes_the_gc_heap_until_close(artifact):
    """A full garbage collection scans every tracked object; once loaded, the engine's (and the
    libraries') objects sit in the permanent generation, so a collection while serving scans only
    what was made since. close() hands them back to the collector."""
    import gc

    engine = Engine(artifact, device="cpu", max_num_seqs=4, disable_log_stats=True)
    try:
        frozen, tracked = gc.get_freeze_count(), len(gc.get_objects())
        assert frozen > 10 * tracked  # the bulk of the heap is frozen
        engine.add_request("the king", SamplingParams(temperature=0, max_tokens=4))
        while engine.has_unfinished_requests():
            engine.step()
        assert gc.get_freeze_count() > 10 * len(gc.get_objects())  # serving adds little; nothing is unfrozen
        other = Engine(artifact, device="cpu", max_num_seqs=4, disable_log_stats=True)
        other.close()  # another engine of the process closing leaves this one's heap frozen
        other.close()  # (idempotent: a second close does not count twice)
        assert gc.get_freeze_count() > 10 * len(gc.get_objects())
    finally:
        engine.close()
    assert gc.get_freeze_count() == 0


def _final_outputs(artifact, requests, options) -> dict:
    """requests (id, prompt, params, arrival step) through one engine; the final output of each."""
    engine = Engine(artifact, device="cpu", disable_log_stats=True, **{"max_num_seqs": 8, **options})
    pending, outputs, step = sorted(requests, key=lambda r: r[3]), {}, 0
    while engine.has_unfinished_requests() or pending:
        while pending and pending[0][3] <= step:
            request_id, prompt, params, _ = pending.pop(0)
            engine.add_request(prompt, params.replace(output_kind=RequestOutputKind.FINAL_ONLY), request_id=request_id)
        outputs |= {o.request_id: o for o in engine.step() if o.finished}
        step += 1
    return outputs


@pytest.mark.parametrize("seed,options", [pytest.param(0, {"max_num_batched_tokens": 24}, marks=pytest.mark.slow),  # 11 s
                                          (1, {"num_kv_blocks": 30})], ids=["chunked", "preemption"])
def test_greedy_and_seeded_requests_in_a_crowd_give_what_they_give_alone(artifact, seed, options):
    """Batch invariance: a greedy or seeded request among random others (every sampling field, logprobs
    of other counts, grammars, penalties) gets the tokens, text, finish reason and logprobs it gets alone,
    and no logprob is above 0. (Logprobs of a request asking fewer top entries than another once held the
    other's token ids.) Tokens tied at -inf may come in any order, so only finite entries are compared."""
    rng = random.Random(seed)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))) for _ in range(5)]
    requests = [(f"r{i}", rng.choice(prefixes), _random_params(rng), rng.randint(0, 6)) for i in range(12)]
    crowd = _final_outputs(artifact, requests, options)
    checked = 0
    for request_id, prompt, params, _ in requests:
        if params.temperature != 0 and params.seed is None:
            continue
        alone = _final_outputs(artifact, [(request_id, prompt, params, 0)], options)[request_id]
        assert ([(c.token_ids, c.text, c.finish_reason) for c in crowd[request_id].outputs]
                == [(c.token_ids, c.text, c.finish_reason) for c in alone.outputs]), request_id
        for got, expected in zip(crowd[request_id].outputs, alone.outputs):
            for step_got, step_expected in zip(got.logprobs or [], expected.logprobs or []):
                finite = {t: v for t, v in step_got.items() if v != float("-inf")}
                assert all(v <= 1e-6 for v in finite.values()), step_got
                assert finite.keys() == {t for t, v in step_expected.items() if v != float("-inf")}
                assert all(abs(v - step_expected[t]) < 1e-4 for t, v in finite.items())
        checked += 1
    assert checked >= 4
