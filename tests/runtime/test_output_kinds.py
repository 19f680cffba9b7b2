"""SamplingParams.output_kind (vLLM's RequestOutputKind): CUMULATIVE returns the whole output after
every step, DELTA what each step added, FINAL_ONLY one output at the end. All three describe the same
generation: deltas concatenate to the cumulative output, the final-only output equals the last
cumulative one, and the text is the tokenizer's decode of the token ids."""

import dataclasses
import random

import pytest
from transformers import AutoTokenizer

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import RequestError
from llmc.runtime.engine import Engine
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import RequestOutputKind, SamplingParams

KINDS = list(RequestOutputKind)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, ref_model_dir):
    out = tmp_path_factory.mktemp("output_kinds") / "ref"
    build(recipe_from_dict({"model": str(ref_model_dir), "output": str(out), "dtype": "float32",
                            "runtime": {"max_model_len": 192}}), show_progress=False)
    return out


def _workload(kind: RequestOutputKind) -> list[tuple[str, SamplingParams]]:
    rng = random.Random(0)
    words = ("the king", "my lord", "ROMEO:", "sweet love", "of the night", "and then", "I pray you")
    params = [
        SamplingParams(temperature=0, max_tokens=20),
        SamplingParams(temperature=1.0, top_k=5, seed=12, max_tokens=16, n=2, logprobs=2),
        SamplingParams(temperature=0, max_tokens=24, stop=["\n\n", " the"]),
        SamplingParams(temperature=0.7, seed=14, max_tokens=14, prompt_logprobs=1, skip_special_tokens=False),
        SamplingParams(temperature=0, max_tokens=30, min_tokens=3),  # may end at eos
    ]
    return [(" ".join(rng.choice(words) for _ in range(rng.randint(2, 30))),
             params[i % len(params)].replace(output_kind=kind)) for i in range(15)]


def _run(artifact, kind: RequestOutputKind, **options) -> dict[str, list]:
    """Every output of every request, in order, by request id."""
    engine = Engine(artifact, device="cpu", max_num_seqs=6, disable_log_stats=True, **options)
    for i, (prompt, params) in enumerate(_workload(kind)):
        engine.add_request(prompt, params, request_id=f"r{i}")
    outputs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    assert engine.scheduler.block_pool.num_free_blocks == engine.stats()["num_total_blocks"]
    return outputs


@pytest.fixture(scope="module")
def cumulative(artifact):
    return _run(artifact, RequestOutputKind.CUMULATIVE)


@pytest.fixture(scope="module")
def tokenizer(ref_model_dir):
    return AutoTokenizer.from_pretrained(ref_model_dir)


def test_final_only_returns_one_output_equal_to_the_last_cumulative(artifact, cumulative, tokenizer):
    final = _run(artifact, RequestOutputKind.FINAL_ONLY)
    assert final.keys() == cumulative.keys()
    for request_id, outputs in final.items():
        assert len(outputs) == 1 and outputs[0].finished
        assert dataclasses.replace(outputs[0], metrics={}) == dataclasses.replace(cumulative[request_id][-1], metrics={})
    # the text of a request without stop strings is decoded once, at the end: still the decode of its ids
    for i, (_, params) in enumerate(_workload(RequestOutputKind.FINAL_ONLY)):
        for completion in [] if params.stop else final[f"r{i}"][0].outputs:
            ids = completion.token_ids[:-1] if completion.finish_reason == "stop" else completion.token_ids  # eos
            assert completion.text == tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)


@pytest.mark.parametrize("options", [{}, {"async_scheduling": False}, {"num_kv_blocks": 14, "max_num_batched_tokens": 48}],
                         ids=["overlapped", "synchronous", "preemption"])
def test_deltas_concatenate_to_the_cumulative_output(artifact, cumulative, options):
    deltas = _run(artifact, RequestOutputKind.DELTA, **options)
    assert deltas.keys() == cumulative.keys()
    for request_id, outputs in deltas.items():
        last = cumulative[request_id][-1]
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        assert outputs[0].prompt_logprobs == last.prompt_logprobs
        assert all(o.prompt_logprobs is None for o in outputs[1:])
        for expected in last.outputs:
            parts = [c for o in outputs for c in o.outputs if c.index == expected.index]
            assert all(p.token_ids or p.finish_reason for p in parts)  # a delta always carries something
            assert [p.finish_reason is not None for p in parts].count(True) == 1 and parts[-1].finish_reason
            assert "".join(p.text for p in parts) == expected.text
            assert [t for p in parts for t in p.token_ids] == expected.token_ids
            if expected.logprobs is not None:  # a preempted batch differs in float rounding
                got = [lp for p in parts for lp in p.logprobs]
                assert [sorted(lp) for lp in got] == [sorted(lp) for lp in expected.logprobs]
                assert [sorted(lp.values()) for lp in got] == [pytest.approx(sorted(lp.values()), abs=1e-4)
                                                                for lp in expected.logprobs]
                assert parts[-1].cumulative_logprob == pytest.approx(expected.cumulative_logprob, abs=1e-3)
            assert (parts[-1].finish_reason, parts[-1].stop_reason) == (expected.finish_reason, expected.stop_reason)


def test_llm_generate_asks_for_final_outputs_and_stream_for_deltas(artifact):
    llm = LLM(artifact, device="cpu", disable_log_stats=True)
    params = SamplingParams(temperature=0, max_tokens=24)
    [generated] = llm.generate("ROMEO: the king", params)
    assert params.output_kind is RequestOutputKind.CUMULATIVE  # the caller's params are not changed
    deltas = list(llm.stream("ROMEO: the king", params))
    assert len(deltas) > 1 and "".join(deltas) == generated.outputs[0].text
    [two] = llm.generate("ROMEO: the king", params.replace(n=2, temperature=1.0, seed=3))
    assert "".join(llm.stream("ROMEO: the king", params.replace(n=2, temperature=1.0, seed=3))) == two.outputs[0].text
    with pytest.raises(RequestError, match="LLM.stream takes no best_of > n"):
        llm.stream("ROMEO:", params.replace(best_of=2, temperature=1.0))
    seen = []
    add_request = llm.engine.add_request
    llm.engine.add_request = lambda prompt, p, *args, **kwargs: seen.append(p.output_kind) or add_request(prompt, p, *args, **kwargs)
    llm.generate(["a", "b"], params)
    llm.chat([{"role": "user", "content": "hi"}], params)
    list(llm.stream("c", params))
    assert seen == [RequestOutputKind.FINAL_ONLY] * 3 + [RequestOutputKind.DELTA]


def test_output_kind_is_validated():
    with pytest.raises(RequestError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="delta")
    with pytest.raises(RequestError, match="output_kind must be CUMULATIVE or FINAL_ONLY when best_of"):
        SamplingParams(n=1, best_of=3, output_kind=RequestOutputKind.DELTA)
    SamplingParams(n=1, best_of=3, output_kind=RequestOutputKind.FINAL_ONLY)


def test_stream_interval_batches_delta_outputs(artifact):
    """vLLM's stream_interval 4: a DELTA request's first token comes alone, then 4 tokens an output, the rest with the
    finish; the deltas join into the FINAL_ONLY output (the engine runs the same steps either way)."""
    prompt = "ROMEO: what light"
    params = SamplingParams(temperature=0, max_tokens=19, ignore_eos=True)
    engine = Engine(artifact, device="cpu", stream_interval=4)
    engine.add_request(prompt, dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY), request_id="f")
    engine.add_request(prompt, dataclasses.replace(params, output_kind=RequestOutputKind.DELTA), request_id="d")
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == "d":
                deltas.append(output.outputs[0])
            else:
                final = output.outputs[0]
    assert [len(d.token_ids) for d in deltas] == [1, 4, 4, 4, 4, 2]
    assert [t for d in deltas for t in d.token_ids] == final.token_ids
    assert "".join(d.text for d in deltas) == final.text and deltas[-1].finish_reason == "length"
