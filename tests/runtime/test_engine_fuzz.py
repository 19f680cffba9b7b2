"""A seeded randomized differential test of the engine across its features (session 45).

Each seed draws an engine (token budget, rows, a tiny KV cache or not, prefix caching, the scheduling
policy, n-gram or draft-model speculation, run-time LoRA, prompt embeds) and a workload of requests arriving
over the first steps, each with a random mix of what it can combine: text, token ids or embeddings as the
prompt, a LoRA adapter, a cache salt, a priority, n and best_of, seeds, penalties, logit bias, allowed ids,
bad words, min_tokens, stop strings and ids, logprobs and prompt logprobs, a regex or a JSON schema, beam
search; a few are aborted mid-stream, and a few ask for a combination llmc refuses by name. Checked:

* the overlapped engine gives the synchronous engine's outputs (async_scheduling false, the reference path):
  tokens, text, finish reasons, and logprobs to float32 batch-order noise;
* a greedy or seeded request gives inside the crowd what it gives alone (batch invariance, as
  test_engine_invariance.py claims it on the CPU);
* a refused combination is one RequestError at add_request, leaving nothing behind;
* no request fails and the engine never resets; after the last step every KV block is free, every
  persistent-batch row too, no request is left in a queue or a map, and the counters agree with what was
  delivered; an aborted request says nothing after its abort.

The default run draws one text seed (~9 s on 2 cores); `-m slow` draws many more, and the vision requests'.
"""

from __future__ import annotations

import random

import pytest
import torch

from llmc.errors import RequestError
from llmc.runtime.engine import Engine
from llmc.runtime.lora import LoRARequest
from llmc.runtime.sampling_params import RequestOutputKind, SamplingParams
from llmc.runtime.structured_output import StructuredOutputsParams
from tests.runtime.hf_oracle import build_float32, make_peft_adapter

peft = pytest.importorskip("peft")

WORDS = ("the king", "my lord", "ROMEO:", "sweet love", "of the night", "and then", "I pray you", "good sir")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_llama):
    """tiny_llama in float32, two PEFT adapters of it, and its embedding table (for prompt embeds)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("engine-fuzz")
    artifact = build_float32(tiny_llama, root / "base")
    adapters = [make_peft_adapter(tiny_llama, root / "attn", 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                make_peft_adapter(tiny_llama, root / "mlp", 2, r=2, lora_alpha=4, target_modules=["down_proj"])]
    table = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).get_input_embeddings().weight
    return artifact, [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)], table.detach().clone()


def _engine_options(rng: random.Random, artifact) -> dict:
    """One engine's settings; run-time LoRA and prompt embeds exclude a draft model (refused by name)."""
    options = {"max_model_len": 128, "max_num_seqs": rng.choice([3, 4, 8]),
               "max_num_batched_tokens": rng.choice([16, 32, 64, 256]),
               "enable_prefix_caching": rng.random() < 0.6,
               "scheduling_policy": rng.choice(["fcfs", "priority"])}
    options["block_size"] = block_size = rng.choice([8, 16, 16, 32])
    if rng.random() < 0.4:  # a tiny cache: preemption (128 tokens hold one max_model_len sequence)
        options["num_kv_blocks"] = rng.choice([144, 192, 256]) // block_size
    if rng.random() < 0.2:
        options["long_prefill_token_threshold"] = rng.choice([8, 24])
    if rng.random() < 0.2:
        options["stream_interval"] = rng.choice([2, 5])
    if rng.random() < 0.15:
        options["kv_cache_dtype"] = "fp8"
    speculative = rng.choice([None, None, "ngram", "draft"])
    if speculative == "draft":
        options["speculative"] = {"model": str(artifact), "num_speculative_tokens": rng.choice([1, 3])}
    else:
        if speculative == "ngram":
            options["speculative"] = {"method": "ngram", "num_speculative_tokens": rng.choice([1, 3])}
        options["enable_lora"] = rng.random() < 0.5
        if options["enable_lora"]:
            options |= {"max_loras": rng.choice([1, 2]), "max_lora_rank": 4}
        options["enable_prompt_embeds"] = rng.random() < 0.5
    return options


def _sampling(rng: random.Random, beams: bool) -> SamplingParams:
    """Any mix of the sampling, stopping and output fields (a beam search takes only its own)."""
    kind = rng.choice(list(RequestOutputKind))
    if beams and rng.random() < 0.1:
        return SamplingParams(use_beam_search=True, n=2, temperature=0.0, max_tokens=rng.randint(1, 12),
                              length_penalty=rng.choice([1.0, 0.5]), ignore_eos=rng.random() < 0.5,
                              output_kind=RequestOutputKind.FINAL_ONLY if kind is RequestOutputKind.DELTA else kind)
    kw = {"max_tokens": rng.randint(1, 24), "output_kind": kind}
    if rng.random() < 0.6:
        kw |= {"temperature": rng.choice([0.5, 1.0, 1.3]), "seed": rng.randrange(1000)}
        for name, values, chance in [("top_p", [0.5, 0.9], 0.4), ("top_k", [1, 5, 40], 0.4), ("min_p", [0.02, 0.1], 0.3)]:
            if rng.random() < chance:
                kw[name] = rng.choice(values)
        if rng.random() < 0.3:
            kw["n"] = rng.choice([2, 3])
            if rng.random() < 0.3 and kind is not RequestOutputKind.DELTA:
                kw["best_of"] = kw["n"] + 1
    else:
        kw["temperature"] = 0.0
    for name, values, chance in [
        ("presence_penalty", [0.3, -0.5], 0.2), ("frequency_penalty", [0.3, 0.8], 0.2),
        ("repetition_penalty", [1.2, 0.9], 0.2), ("stop", [["\n"], [" the", "lord"], [",", "ing"]], 0.3),
        ("include_stop_str_in_output", [True], 0.2), ("ignore_eos", [True], 0.3), ("logprobs", [0, 1, 3], 0.3),
        ("bad_words", [["the", "lord"], ["king"]], 0.1), ("prompt_logprobs", [0, 2], 0.1),
    ]:
        if rng.random() < chance:
            kw[name] = rng.choice(values)
    if rng.random() < 0.2:
        kw["stop_token_ids"] = [rng.randrange(2000) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.2:
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
    if rng.random() < 0.2:
        kw["logit_bias"] = {rng.randrange(2000): rng.choice([-100.0, 5.0, 2.0]) for _ in range(3)}
    if rng.random() < 0.1:
        kw["allowed_token_ids"] = [rng.randrange(2000) for _ in range(50)]
    elif rng.random() < 0.15:
        kw["structured_outputs"] = StructuredOutputsParams(**rng.choice(
            [{"regex": "[a-z ]{4,12}"}, {"regex": "(yes|no), my lord"}, {"json": SCHEMA}, {"choice": ["aye", "nay"]}]))
    return SamplingParams(**kw)


def _refused(rng: random.Random, options: dict, adapters, table) -> tuple[dict, str]:
    """A request llmc refuses by name on this engine (its add_request keywords, made when called: a
    SamplingParams may refuse itself), and a word of the message."""
    cases = [(lambda: {"params": SamplingParams(use_beam_search=True, n=2), "cache_salt": "s"}, "cache_salt"),
             (lambda: {"params": SamplingParams(use_beam_search=True, n=2, logprobs=1)}, "beam search"),
             (lambda: {"params": SamplingParams(max_tokens=4, logprobs=10_000)}, "max_logprobs"),
             (lambda: {"params": SamplingParams(max_tokens=4, logit_bias={10_000: 1.0})}, "vocabulary"),
             (lambda: {"params": SamplingParams(max_tokens=4), "prompt": " ".join(["the king"] * 90)}, "max_model_len"),
             (lambda: {"params": SamplingParams(max_tokens=4), "priority": 3}, "priority"),
             (lambda: {"params": SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
                 json={"type": "array", "uniqueItems": True}))}, "uniqueItems"),
             (lambda: {"params": SamplingParams(max_tokens=4), "prompt": None, "prompt_token_ids": []}, "empty"),
             (lambda: {"params": SamplingParams(max_tokens=4), "cache_salt": ""}, "cache_salt")]
    if options.get("enable_lora"):
        cases.append((lambda: {"params": SamplingParams(use_beam_search=True, n=2), "lora_request": adapters[0]}, "lora_request"))
    else:
        cases.append((lambda: {"params": SamplingParams(max_tokens=4), "lora_request": adapters[0]}, "enable_lora"))
    if options.get("enable_prompt_embeds"):
        cases.append((lambda: {"params": SamplingParams(max_tokens=4, prompt_logprobs=1), "prompt": None,
                       "prompt_embeds": table[5:9]}, "prompt_logprobs"))
    else:
        cases.append((lambda: {"params": SamplingParams(max_tokens=4), "prompt": None, "prompt_embeds": table[5:9]}, "prompt_embeds"))
    if "speculative" in options:
        cases.append((lambda: {"params": SamplingParams(use_beam_search=True, n=2)}, "speculative"))
    case, word = rng.choice(cases)
    if word == "priority" and options["scheduling_policy"] == "priority":
        return lambda: {"params": SamplingParams(max_tokens=4, stop=[""])}, "stop"
    return case, word


def _workload(seed: int, artifact, adapters, table) -> tuple[dict, list, dict, list]:
    """(engine options, requests (id, add_request keywords, arrival step), aborts {id: outputs seen before
    aborting}, refused (keywords, word, arrival step))."""
    rng = random.Random(seed)
    options = _engine_options(rng, artifact)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 25))) for _ in range(4)]
    requests = []
    for i in range(rng.randint(4, 14)):
        prompt = rng.choice(prefixes) + (" " + rng.choice(WORDS) if rng.random() < 0.5 else "")
        # beams that cannot all hold their KV at once are refused by name (their own test: test_beam_search.py)
        beams = "speculative" not in options and options.get("num_kv_blocks", 99) * options["block_size"] >= 192
        kw = {"prompt": prompt, "params": _sampling(rng, beams)}
        beams = kw["params"].use_beam_search
        if options.get("enable_prompt_embeds") and rng.random() < 0.3 and not beams:
            kw["params"] = kw["params"].replace(prompt_logprobs=None)
            first = rng.randrange(100, 2000)
            kw |= {"prompt": None, "prompt_embeds": table[first:first + rng.randint(1, 20)].clone()}
        elif rng.random() < 0.3:
            kw |= {"prompt": None, "prompt_token_ids": [rng.randrange(5, 4000) for _ in range(rng.randint(1, 40))]}
        if options.get("enable_lora") and rng.random() < 0.6 and not beams:
            kw["lora_request"] = rng.choice(adapters)
        if rng.random() < 0.15 and not beams:
            kw["cache_salt"] = rng.choice(["tenant-a", "tenant-b"])
        if options["scheduling_policy"] == "priority":
            kw["priority"] = rng.choice([0, 0, 1, -1])
        requests.append((f"r{i}", kw, rng.randint(0, 10)))
    aborts = {f"r{rng.randrange(len(requests))}": rng.randint(0, 5) for _ in range(rng.randint(0, 2))}
    refused = [(*_refused(rng, options, adapters, table), rng.randint(0, 8)) for _ in range(rng.randint(0, 2))]
    return options, requests, aborts, refused


def _drive(artifact, options: dict, requests, aborts: dict, refused=()) -> tuple[dict, Engine]:
    """Run the workload through one engine, checking what holds at every step and at the end; every
    output of each request, by request id."""
    engine = Engine(artifact, device="cpu", disable_log_stats=True, **options)
    outputs: dict[str, list] = {}
    aborted: set[str] = set()
    step = 0
    try:
        while engine.has_unfinished_requests() or step <= 10:
            for request_id, kw, arrival in requests:
                if arrival == step:
                    kw = dict(kw)
                    engine.add_request(kw.pop("prompt"), kw.pop("params"), request_id=request_id, **kw)
            for i, (make, word, arrival) in enumerate(refused):
                if arrival == step:
                    before = (set(engine.groups), engine.stats()["num_free_blocks"])
                    with pytest.raises(RequestError, match=word):
                        kw = make()
                        engine.add_request(kw.pop("prompt", "the king"), kw.pop("params"), request_id=f"x{i}", **kw)
                    assert (set(engine.groups), engine.stats()["num_free_blocks"]) == before
            for output in engine.step():
                assert output.error is None, (output.request_id, output.error)
                assert output.request_id not in aborted, f"{output.request_id}: an output after its abort"
                outputs.setdefault(output.request_id, []).append(output)
            for request_id, num_outputs in aborts.items():
                if len(outputs.get(request_id, [])) >= num_outputs and request_id in engine.groups:
                    sequences = [state.request for state in engine.groups[request_id].sequences]
                    engine.abort_request(request_id)
                    aborted.add(request_id)
                    for request in sequences:  # every live sequence ends aborted, its blocks freed at once
                        assert request.is_finished and not request.block_ids, request
                        assert request.request_id not in engine.sequences and request.batch_row is None
                    assert request_id not in engine.groups
            step += 1
            assert step < 2000, "the engine does not finish"
        assert engine.num_resets == 0
        _check_idle(engine)
    finally:
        engine.close()
    return outputs, engine


def _check_idle(engine: Engine) -> None:
    """Nothing is left anywhere once every request has finished or been aborted."""
    engine.scheduler.check_invariants()
    scheduler, stats = engine.scheduler, engine.stats()
    assert not engine.groups and not engine.sequences and not engine._beam_group_ids
    assert not scheduler.running and not scheduler.waiting and not scheduler.requests and engine._in_flight is None
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"], "KV blocks leaked"
    assert stats["kv_cache_usage"] == 0.0
    assert sorted(engine._free_rows) == list(range(engine.options.max_num_seqs)), "persistent-batch rows leaked"
    assert 0 <= stats["prefix_cache_hits"] <= stats["prefix_cache_queries"]
    assert 0 <= stats["num_spec_accepted"] <= stats["num_spec_proposed"]
    if engine.options.speculative is None:
        assert stats["num_spec_proposed"] == 0
    if not engine.options.enable_prefix_caching:
        assert stats["prefix_cache_hits"] == 0


def _summary(requests, aborts: dict, outputs: dict) -> dict:
    """What each request not aborted was given: completions (token ids, text, finish reason, logprobs)
    of its last output, or its deltas joined per sequence; its prompt logprobs."""
    summary = {}
    for request_id, kw, _ in requests:
        if request_id in aborts:
            continue
        got, params = outputs[request_id], kw["params"]
        last = got[-1]
        assert last.finished and all(c.finish_reason in ("stop", "length") for c in last.outputs), last
        if params.output_kind is RequestOutputKind.FINAL_ONLY:
            assert len(got) == 1
        if params.output_kind is RequestOutputKind.DELTA:
            joined: dict[int, tuple] = {}
            for output in got:
                for c in output.outputs:
                    ids, text, _, lps = joined.get(c.index, ((), "", None, ()))
                    joined[c.index] = (ids + tuple(c.token_ids), text + c.text, c.finish_reason,
                                       lps + tuple(c.logprobs or ()))
            completions = [joined[i] for i in sorted(joined)]
        else:
            completions = [(tuple(c.token_ids), c.text, c.finish_reason, tuple(c.logprobs or ())) for c in last.outputs]
        prompt_logprobs = next((o.prompt_logprobs for o in got if o.prompt_logprobs is not None), None)
        summary[request_id] = (completions, prompt_logprobs)
    return summary


def _same_logprobs(got, expected, tolerance: float) -> None:
    """Logprob dicts step by step: the same finite token ids, values within `tolerance`."""
    assert len(got) == len(expected)
    for step_got, step_expected in zip(got, expected):
        if step_got is None or step_expected is None:
            assert step_got is None and step_expected is None
            continue
        finite = {t: v for t, v in step_got.items() if v != float("-inf")}
        assert finite.keys() == {t for t, v in step_expected.items() if v != float("-inf")}
        assert all(abs(v - step_expected[t]) < tolerance for t, v in finite.items()), (step_got, step_expected)


def _assert_same(got: dict, expected: dict, tolerance: float = 1e-3) -> None:
    assert got.keys() == expected.keys()
    for request_id in got:
        (completions, prompt_lps), (ref_completions, ref_prompt_lps) = got[request_id], expected[request_id]
        assert [c[:3] for c in completions] == [c[:3] for c in ref_completions], request_id
        for c, ref in zip(completions, ref_completions):
            _same_logprobs(c[3], ref[3], tolerance)
        assert (prompt_lps is None) == (ref_prompt_lps is None), request_id
        if prompt_lps is not None:
            _same_logprobs(prompt_lps, ref_prompt_lps, tolerance)


def _check_counters(requests, aborts: dict, summary: dict, engine: Engine) -> None:
    """The token counters against what was delivered, where that is exact: with nothing aborted, every
    sequence returned (no best_of above n) and no beam search, num_generation_tokens is the number of
    tokens handed out (a token computed after a stop is not counted); with no preemption and no prefix
    cache hit either, num_prompt_tokens is every sequence's prompt, once per sequence (n of them)."""
    plain = not aborts and all(not kw["params"].use_beam_search and kw["params"].best_of in (None, kw["params"].n)
                               for _, kw, _ in requests)
    if not plain:
        return
    stats = engine.stats()
    delivered = sum(len(c[0]) for completions, _ in summary.values() for c in completions)
    assert stats["num_generation_tokens"] == delivered, (stats, delivered)
    images = any("multi_modal_data" in kw for _, kw, _ in requests)  # (their prompts grow by the images' tokens)
    if stats["num_preemptions"] == 0 and stats["prefix_cache_hits"] == 0 and not images:
        prompts = sum(_prompt_len(kw, engine.tokenizer) * kw["params"].n for _, kw, _ in requests)
        assert stats["num_prompt_tokens"] == prompts, (stats, prompts)


def _prompt_len(kw: dict, tokenizer) -> int:
    if kw.get("prompt_embeds") is not None:
        return len(kw["prompt_embeds"])
    if kw.get("prompt_token_ids") is not None:
        return len(kw["prompt_token_ids"])
    return len(tokenizer(kw["prompt"]).input_ids)  # the Hugging Face tokenizer's, BOS included


def test_drafts_accepted_after_a_stop_string_are_not_counted(setup):
    """A stop string inside a step's accepted drafts ends the sequence there: the tokens after it are dropped
    and num_generation_tokens does not count them (it counted every accepted token: more than delivered).
    The model is its own draft, so every draft is accepted and the stops fall inside verified runs."""
    artifact = setup[0]
    options = {"max_model_len": 128, "speculative": {"model": str(artifact), "num_speculative_tokens": 4}}
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs, _ = _drive(artifact, options, [("free", {"prompt": "ROMEO: my lord", "params": greedy}, 0)], {})
    text = outputs["free"][-1].outputs[0].text
    stops = [piece for piece in (text[i:i + 2] for i in range(4, len(text) - 4, 3)) if piece.strip()]
    requests = [(f"r{i}", {"prompt": "ROMEO: my lord", "params": greedy.replace(stop=[stop])}, 0)
                for i, stop in enumerate(stops)]
    outputs, engine = _drive(artifact, options, requests, {})
    summary = _summary(requests, {}, outputs)
    assert engine.stats()["num_spec_accepted"] > 0
    assert all(completions[0][2] == "stop" for completions, _ in summary.values())
    _check_counters(requests, {}, summary, engine)


def _is_reproducible(params: SamplingParams) -> bool:
    return params.temperature == 0 or params.seed is not None or params.use_beam_search


def check_seed(setup, seed: int, alone: bool = True) -> None:
    artifact, adapters, table = setup
    options, requests, aborts, refused = _workload(seed, artifact, adapters, table)
    sync_outputs, sync_engine = _drive(artifact, {**options, "async_scheduling": False}, requests, aborts)
    outputs, engine = _drive(artifact, options, requests, aborts, refused)
    overlapped, synchronous = _summary(requests, aborts, outputs), _summary(requests, aborts, sync_outputs)
    _assert_same(overlapped, synchronous)
    _check_counters(requests, aborts, overlapped, engine)
    _check_counters(requests, aborts, synchronous, sync_engine)
    if not alone:
        return
    chosen = [(rid, kw) for rid, kw, _ in requests if rid not in aborts and _is_reproducible(kw["params"])]
    for request_id, kw in chosen[:3]:
        single, _ = _drive(artifact, options, [(request_id, kw, 0)], {})
        (completions, _), (ref, _) = _summary([(request_id, kw, 0)], {}, single)[request_id], overlapped[request_id]
        assert [c[:3] for c in completions] == [c[:3] for c in ref], (request_id, kw)
        for c, r in zip(completions, ref):
            _same_logprobs(c[3], r[3], 1e-3)


@pytest.mark.parametrize("seed", range(1))
def test_random_workloads_agree(setup, seed):
    """One seed in the default run."""
    check_seed(setup, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(1, 60))
def test_random_workloads_agree_many_seeds(setup, seed):
    check_seed(setup, seed)


# ---- vision requests: Qwen2-VL's M-RoPE (decodes rotate at index + the request's rope delta) ----------------


@pytest.fixture(scope="module")
def vision_setup(tmp_path_factory):
    """A tiny Qwen2-VL in float32 and three pictures (12, 12 and 4 image tokens)."""
    from tests.runtime.test_llava import image
    from tests.runtime.test_qwen2_vl import make_qwen_vl_checkpoint

    root = tmp_path_factory.mktemp("engine-fuzz-vl")
    artifact = build_float32(make_qwen_vl_checkpoint(root / "hf"), root / "a", target={"device": "cpu"})
    return artifact, [image(1, (64, 48)), image(2, (96, 32)), image(3, (40, 36))]


def _vision_workload(seed: int, pictures) -> tuple[dict, list, dict, list]:
    """Text-only requests and requests of one or two images (some sharing a picture, so a prefix-cache hit
    can end inside an image), under chunking, preemption, prefix caching and n-gram speculation."""
    rng = random.Random(seed)
    options = {"max_model_len": 128, "max_num_seqs": rng.choice([3, 4, 8]),
               "max_num_batched_tokens": rng.choice([8, 16, 32, 256]), "enable_prefix_caching": rng.random() < 0.7}
    if rng.random() < 0.4:
        options["num_kv_blocks"] = rng.choice([9, 12])
    if rng.random() < 0.3:
        options["speculative"] = {"method": "ngram", "num_speculative_tokens": rng.choice([1, 3])}
    pad = "<|vision_start|><|image_pad|><|vision_end|>"
    heads = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 6))) for _ in range(3)]
    requests = []
    for i in range(rng.randint(4, 10)):
        num_images = rng.choice([0, 1, 1, 2])
        chosen = [rng.choice(pictures) for _ in range(num_images)]
        prompt = rng.choice(heads) + "".join(pad + rng.choice(WORDS) for _ in chosen) + " " + rng.choice(WORDS)
        kw = {"prompt": prompt, "params": _sampling(rng, beams=False)}
        if chosen:
            kw["multi_modal_data"] = {"image": chosen if len(chosen) > 1 else chosen[0]}
        requests.append((f"r{i}", kw, rng.randint(0, 8)))
    aborts = {f"r{rng.randrange(len(requests))}": rng.randint(0, 4) for _ in range(rng.randint(0, 2))}
    refused = [(lambda: {"prompt": "look" + pad, "params": SamplingParams(use_beam_search=True, n=2),
                         "multi_modal_data": {"image": pictures[0]}}, "multi_modal_data", rng.randint(0, 5))]
    return options, requests, aborts, refused


def check_vision_seed(vision_setup, seed: int) -> None:
    artifact, pictures = vision_setup
    options, requests, aborts, refused = _vision_workload(seed, pictures)
    sync_outputs, sync_engine = _drive(artifact, {**options, "async_scheduling": False}, requests, aborts)
    outputs, engine = _drive(artifact, options, requests, aborts, refused)
    overlapped = _summary(requests, aborts, outputs)
    _assert_same(overlapped, _summary(requests, aborts, sync_outputs))
    _check_counters(requests, aborts, overlapped, engine)
    chosen = [(rid, kw) for rid, kw, _ in requests if rid not in aborts and _is_reproducible(kw["params"])]
    for request_id, kw in chosen[:2]:
        single, _ = _drive(artifact, options, [(request_id, kw, 0)], {})
        (completions, _), (ref, _) = _summary([(request_id, kw, 0)], {}, single)[request_id], overlapped[request_id]
        assert [c[:3] for c in completions] == [c[:3] for c in ref], (request_id, kw)


@pytest.mark.slow  # 13 s a seed; tests/runtime/test_qwen2_vl.py serves vision requests in the default run
@pytest.mark.parametrize("seed", range(40))
def test_random_vision_workloads_agree(vision_setup, seed):
    check_vision_seed(vision_setup, seed)


@pytest.fixture(scope="module")
def qwen3_vision_setup(tmp_path_factory):
    """A tiny Qwen3-VL in float32 (deepstack rows into decoder layers 0 and 1, interleaved M-RoPE) and
    vision_setup's three pictures."""
    from tests.runtime.test_llava import image
    from tests.runtime.test_qwen3_vl import make_qwen3_vl_checkpoint

    root = tmp_path_factory.mktemp("engine-fuzz-qwen3-vl")
    artifact = build_float32(make_qwen3_vl_checkpoint(root / "hf"), root / "a", target={"device": "cpu"})
    return artifact, [image(1, (64, 48)), image(2, (96, 32)), image(3, (40, 36))]


@pytest.mark.slow  # tests/runtime/test_qwen3_vl.py serves Qwen3-VL's requests in the default run
@pytest.mark.parametrize("seed", range(8))
def test_random_qwen3_vl_workloads_agree(qwen3_vision_setup, seed):
    """The vision workloads on Qwen3-VL: each step's deepstack rows go to its own image tokens wherever a batch,
    a chunk, a prefix-cache hit or a preemption puts them (a request alone gives what it gives crowded)."""
    check_vision_seed(qwen3_vision_setup, seed)
