"""Structured output and bad words through the engine: every sampled output follows its constraint,
checked by an independent validator (jsonschema for JSON schemas, Python's `re` for regexes), on a
random tiny llama (uniform-ish logits that push hard against the grammar) and ref-llama-12m."""

import json
import re

import jsonschema
import pytest

from llmc.compiler.build import build
from llmc.compiler.recipe import recipe_from_dict
from llmc.errors import RequestError
from llmc.runtime.llm import LLM
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.structured_output import GuidedDecodingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["calm", "angry"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["name", "age", "mood", "tags"],
    "additionalProperties": False,
}


def _artifact(tmp_path_factory, model, name):
    out = tmp_path_factory.mktemp(name) / "model"
    build(recipe_from_dict({"model": str(model), "output": str(out), "dtype": "float32",
                            "runtime": {"max_model_len": 160}}), show_progress=False)
    return out


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory, tiny_llama):
    with LLM(_artifact(tmp_path_factory, tiny_llama, "guided_tiny"), max_num_seqs=64, disable_log_stats=True) as llm:
        yield llm


@pytest.fixture(scope="module")
def ref_llm(tmp_path_factory, ref_model_dir):
    # (on a GPU machine it runs there: 0.4 of it, so that the cuda case's own engine fits beside it)
    with LLM(_artifact(tmp_path_factory, ref_model_dir, "guided_ref"), max_num_seqs=32, disable_log_stats=True,
             gpu_memory_utilization=0.4) as llm:
        yield llm


def _texts(llm, params, num=1, prompt="ROMEO:"):
    outputs = llm.generate([prompt] * num, params)
    for output in outputs:
        assert output.outputs[0].finish_reason == "stop", output.outputs[0]
    return [o.outputs[0].text for o in outputs]


@pytest.mark.parametrize("which", ["tiny_llm", pytest.param("ref_llm", marks=pytest.mark.slow)])  # ref_llm: 7 s
def test_json_schema_outputs_validate_at_temperature_1(request, which):
    llm = request.getfixturevalue(which)
    params = SamplingParams(temperature=1.0, seed=None, max_tokens=100, guided_decoding=GuidedDecodingParams(json=SCHEMA))
    texts = _texts(llm, params, num=50)
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 40  # sampled, not one forced answer


def test_json_object_regex_and_choice(ref_llm):
    structured = StructuredOutputsParams(json_object=True)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=120, structured_outputs=structured)
    assert all(isinstance(json.loads(t), dict) for t in _texts(ref_llm, params, num=4))
    pattern = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
    params = SamplingParams(temperature=1.0, max_tokens=40, guided_decoding=GuidedDecodingParams(regex=pattern))
    assert all(re.fullmatch(pattern, t) for t in _texts(ref_llm, params, num=10))
    choices = ["yes", "no", "my lord", "perhaps not"]
    params = SamplingParams(temperature=1.5, max_tokens=20, guided_decoding=GuidedDecodingParams(choice=choices))
    assert set(_texts(ref_llm, params, num=20)) <= set(choices)
    # characters beyond the BMP, and a quote, a backslash and a newline, come out as written (the
    # choices' grammar took 😀 as two lone surrogates: six invalid bytes)
    for choice in ("😀", "日本", 'a "q" \\ b\nc'):
        params = SamplingParams(temperature=0, max_tokens=24, guided_decoding=GuidedDecodingParams(choice=[choice]))
        assert _texts(ref_llm, params) == [choice]


def test_a_grammar_that_forces_a_token_sequence_yields_exactly_it(tiny_llm):
    tokenizer = tiny_llm.tokenizer
    special = set(tokenizer.all_special_ids)
    pieces = [tokenizer.decode([t]) for t in range(len(tokenizer)) if t not in special]
    # Characters that no token of several characters holds: a string of them has one tokenization.
    lonely = sorted({c for p in pieces if len(p) == 1 for c in p} - {c for p in pieces if len(p) > 1 for c in p})
    lonely = [c for c in lonely if c.isprintable() and c not in '"\\']
    assert len(lonely) >= 4, lonely
    digits = "".join(lonely[i % len(lonely)] for i in (3, 0, 2, 1, 3, 3, 0))
    expected = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(c)[0]) for c in digits]
    assert tokenizer.decode(expected) == digits
    grammar = GuidedDecodingParams(grammar=f"root ::= {json.dumps(digits)}")
    for temperature in (0.0, 1.0):
        output = tiny_llm.generate(["x"], SamplingParams(temperature=temperature, max_tokens=30, guided_decoding=grammar))
        completion = output[0].outputs[0]
        assert completion.token_ids[:-1] == expected and completion.text == digits
        assert completion.token_ids[-1] in tiny_llm.engine.eos_token_ids


def test_grammars_compile_once_and_invalid_ones_name_the_field(tiny_llm):
    cache = tiny_llm.engine.grammars
    before = cache.num_compiled
    params = SamplingParams(temperature=0, max_tokens=4, guided_decoding=GuidedDecodingParams(regex="[0-9]{2}"))
    greedy = tiny_llm.generate(["a", "b"], params)  # greedy rows take the bitmask too (no argmax shortcut)
    assert all(re.fullmatch("[0-9]{2}", o.outputs[0].text) for o in greedy)
    tiny_llm.generate(["c"], params.clone())
    assert cache.num_compiled == before + 1
    with pytest.raises(RequestError, match=r"guided_decoding\.json"):
        tiny_llm.generate(["a"], SamplingParams(guided_decoding=GuidedDecodingParams(json={"type": "objectx"})))
    with pytest.raises(RequestError, match=r"guided_decoding must set exactly one"):
        GuidedDecodingParams(regex="a", choice=["b"])
    assert not tiny_llm.engine.has_unfinished_requests()


@pytest.mark.slow  # 18 s on 2 cores
def test_guided_requests_beside_free_ones_overlapped_and_speculative(tmp_path_factory, tiny_llama, tiny_llm):
    """Seeded guided outputs do not depend on overlapped scheduling or on the batch; with n-gram
    speculation (drafts checked against the grammar) they still validate."""
    guided = SamplingParams(temperature=1.0, seed=7, max_tokens=100, guided_decoding=GuidedDecodingParams(json=SCHEMA))
    free = SamplingParams(temperature=1.0, seed=8, max_tokens=30)
    alone = [o.outputs[0].text for o in tiny_llm.generate(["p"], guided)]
    mixed = tiny_llm.generate(["q", "p", "r"], [free, guided, free])
    assert mixed[1].outputs[0].text == alone[0]
    artifact = tiny_llm.engine.artifact_dir
    with LLM(artifact, async_scheduling=False, disable_log_stats=True) as sync_llm:
        assert sync_llm.generate(["p"], guided)[0].outputs[0].text == alone[0]
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    with LLM(artifact, speculative=speculative, disable_log_stats=True) as spec_llm:
        prompt = '{"name": "ab", "age": 1, "mood": "calm", "tags": []} {"name": "ab", "age": 1,'
        params = guided.replace(seed=None, n=1)
        texts = [o.outputs[0].text for o in spec_llm.generate([prompt] * 8, params)]
        for text in texts:
            jsonschema.validate(json.loads(text), SCHEMA)
        assert spec_llm.stats()["num_spec_proposed"] > 0


def _contains(tokens, word):
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


BAD_WORDS_PROMPT = "ROMEO: I pray you, my lord,"


def _bad_words_that_bite(llm) -> tuple[str, str, list[list[int]]]:
    """A one-token word and a phrase of several tokens that greedy decoding of BAD_WORDS_PROMPT
    produces, each with as many tokens after a space as at the start (vLLM bans the spaced form only
    then); and the token sequences banning them bans."""
    free = llm.generate([BAD_WORDS_PROMPT], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    encode = lambda text: llm.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    words = [w for w in free.text.split() if w.isalpha()]
    phrases = [" ".join(pair) for pair in zip(words, words[1:])]
    multi = next(p for p in phrases if len(encode(p)) == len(encode(" " + p)) > 1
                 and _contains(free.token_ids, encode(" " + p)))
    single = next(w for w in words if len(encode(w)) == len(encode(" " + w)) == 1 and w not in multi.split())
    return single, multi, [encode(p + w) for w in (single, multi) for p in ("", " ")]


def test_bad_words_never_appear(ref_llm):
    prompt = BAD_WORDS_PROMPT
    greedy = SamplingParams(temperature=0, max_tokens=40)
    single, multi, banned = _bad_words_that_bite(ref_llm)
    for params in (greedy, SamplingParams(temperature=1.0, seed=5, max_tokens=40, n=4)):
        outputs = ref_llm.generate([prompt], params.replace(bad_words=[single, multi]))[0].outputs
        for completion in outputs:
            assert not any(_contains(completion.token_ids, w) for w in banned), completion.text


@pytest.mark.parametrize("speculative", [None, pytest.param({"method": "ngram", "num_speculative_tokens": 3},
                                                            marks=pytest.mark.slow)])  # 5 s on 2 cores
def test_logprobs_under_bad_words_are_the_raw_models(ref_llm, speculative):
    """vLLM v1 takes logprobs before it bans bad words: a banned token keeps its logprob and rank,
    for one-token and several-token words, with and without n-gram speculation (the reference: the
    same tokens' prompt logprobs, which no bad word touches)."""
    greedy = SamplingParams(temperature=0, max_tokens=40)
    single, multi, _ = _bad_words_that_bite(ref_llm)
    llm = ref_llm if speculative is None else LLM(ref_llm.engine.artifact_dir, speculative=speculative,
                                                  disable_log_stats=True)
    for bad_words in ([single], [multi]):
        output = llm.generate([BAD_WORDS_PROMPT], greedy.replace(logprobs=2, bad_words=bad_words))[0]
        completion = output.outputs[0]
        tokens = output.prompt_token_ids + completion.token_ids
        reference = ref_llm.generate([{"prompt_token_ids": tokens}], SamplingParams(max_tokens=1, prompt_logprobs=2))
        reference = reference[0].prompt_logprobs
        banned_best = 0
        for i, (token, logprobs) in enumerate(zip(completion.token_ids, completion.logprobs)):
            expected = reference[len(output.prompt_token_ids) + i]
            assert logprobs[token].logprob == pytest.approx(expected[token].logprob, abs=1e-4)
            assert logprobs[token].rank == expected[token].rank
            best = {t for t, lp in expected.items() if lp.rank == 1}
            assert best <= logprobs.keys() and all(logprobs[t].rank == 1 for t in best)  # even when banned
            banned_best += token not in best
        assert banned_best >= 1, bad_words  # the word bit: a sampled token was not the model's best
    if llm is not ref_llm:
        assert llm.stats()["num_spec_proposed"] > 0
        llm.close()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_constrained_requests_whose_prompts_take_several_chunks(tmp_path_factory, ref_model_dir, async_scheduling):
    """A step can hold nothing but a constrained request's first prompt chunks, which sample nothing:
    its (empty) bitmask once failed the step and reset the engine. A regex request and a bad-words
    request, each alone, with prompts of four chunks, then both beside a free one."""
    artifact = _artifact(tmp_path_factory, ref_model_dir, "guided_chunks")
    prompt = " ".join(["the king, my lord"] * 12)  # ~60 tokens: 4 chunks of 16
    regex = SamplingParams(temperature=1.0, seed=3, max_tokens=8,
                           structured_outputs=StructuredOutputsParams(regex="[a-z]{3,6}"))
    bad = SamplingParams(temperature=0, max_tokens=12, bad_words=["my lord", "the king"])
    with LLM(artifact, max_num_seqs=4, max_num_batched_tokens=16, async_scheduling=async_scheduling,
             disable_log_stats=True) as llm:
        assert len(llm.tokenizer.encode(prompt)) > 48
        alone = [llm.generate([prompt], params)[0].outputs[0] for params in (regex, bad)]
        together = llm.generate([prompt, prompt, "ROMEO:"], [regex, bad, SamplingParams(temperature=0, max_tokens=4)])
        assert llm.engine.num_resets == 0
    for completion in [alone[0], together[0].outputs[0]]:
        assert completion.finish_reason == "stop" and re.fullmatch("[a-z]{3,6}", completion.text), completion
    for completion in [alone[1], together[1].outputs[0]]:
        assert completion.finish_reason == "length" and len(completion.token_ids) == 12
        assert "my lord" not in completion.text and "the king" not in completion.text, completion.text


SPECULATIVE = {"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1}


@pytest.mark.parametrize("engine_args", [{}, {"async_scheduling": False},
                                         {"speculative": {**SPECULATIVE, "num_speculative_tokens": 1}},
                                         {"speculative": {**SPECULATIVE, "num_speculative_tokens": 3}},
                                         pytest.param({"device": "cuda", "gpu_memory_utilization": 0.4},
                                                      marks=pytest.mark.gpu)],
                         ids=["overlapped", "sync", "ngram-k1", "ngram-k3", "cuda"])
def test_constraints_that_allow_no_token_end_the_sequence(ref_llm, engine_args):
    """A complete regex while min_tokens still bans eos, allowed ids the grammar refuses, allowed ids
    that min_tokens bans, bad words that ban each token a choice can start with: nothing may be sampled, so the sequence ends there ("stop") with what it
    has. Each token sampled instead (token 0 at -inf, or under speculation a draft accepted after
    it) once broke the constraint: n-gram k=1 gave 'noS' for (yes|no)."""
    tokenizer = ref_llm.tokenizer
    eos = ref_llm.engine.eos_token_ids[0]
    prompt = "no no no no no no no no no"
    complete = GuidedDecodingParams(regex="(yes|no)")
    choice = GuidedDecodingParams(choice=["yes", "no"])
    outside = tokenizer.encode(" maybe", add_special_tokens=False)
    cases = [
        SamplingParams(temperature=0, max_tokens=12, min_tokens=8, guided_decoding=complete),
        SamplingParams(temperature=1.0, seed=4, max_tokens=12, min_tokens=8, guided_decoding=complete, logprobs=2),
        SamplingParams(temperature=0, max_tokens=12, guided_decoding=choice, allowed_token_ids=outside),
        SamplingParams(temperature=0.8, seed=1, max_tokens=12, min_tokens=3, allowed_token_ids=[eos]),
        SamplingParams(temperature=0, max_tokens=6, bad_words=["y", "n", "no"], guided_decoding=choice),
    ]
    with LLM(ref_llm.engine.artifact_dir, max_num_seqs=8, disable_log_stats=True, **engine_args) as llm:
        free = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        outputs = llm.generate([prompt] * (len(cases) + 1), [*cases, free])
        pool = llm.engine.scheduler.block_pool
        assert pool.num_free_blocks == pool.num_blocks and not llm.engine.has_unfinished_requests()
    plain = ref_llm.generate([prompt], free)[0].outputs[0]
    assert outputs[-1].outputs[0].token_ids == plain.token_ids  # the rows beside them are untouched
    completions = [o.outputs[0] for o in outputs[:-1]]
    for completion in completions:
        assert completion.finish_reason == "stop" and completion.stop_reason is None, completion
        assert tokenizer.decode(completion.token_ids) == completion.text, completion
        assert eos not in completion.token_ids  # min_tokens bans it, or nothing is sampled
    for completion in completions[:2]:
        assert completion.text in ("yes", "no"), completion
    assert len(completions[1].logprobs) == len(completions[1].token_ids)
    # bad words ban every token that starts "yes" or "no" (y, n, no: one token each)
    assert all(c.token_ids == [] and c.text == "" for c in completions[2:]), completions[2:]


UNENFORCED = [  # (schema, a document jsonschema rejects)
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, ["y", "y"]),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, [2]),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}, "required": ["a"]}, {"a": "x"}),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
      "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}, {"a": 1}),
    ({"type": "object", "properties": {}, "required": ["zz"]}, {}),
    ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, 3),
]


@pytest.mark.parametrize("schema, violation", UNENFORCED)
def test_schemas_whose_keywords_the_grammar_would_not_enforce_are_refused(schema, violation):
    """vLLM refuses schemas its xgrammar backend cannot honour. Each of these xgrammar compiles into a
    grammar that accepts a document jsonschema rejects (checked here), so llmc refuses it by name."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(violation, schema)
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    assert _is_grammar_accept_string(grammar, json.dumps(violation))
    with pytest.raises(RequestError, match=r"guided_decoding\.json: schema\..* is not supported"):
        GuidedDecodingParams(json=schema).grammar_object()


def test_schemas_the_grammar_enforces_are_kept():
    """A property named like a keyword, one allOf reference, a remote $ref refused but a local one kept."""
    kept = [{"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}}, "required": ["not"]},
            {"allOf": [{"$ref": "#/$defs/a"}], "$defs": {"a": {"type": "integer", "minimum": 5}}},
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"], "additionalProperties": True}]
    for schema in kept:
        GuidedDecodingParams(json=schema).grammar_object()
    with pytest.raises(RequestError, match=r"\$ref 'http://example.com/s.json'"):
        GuidedDecodingParams(json={"$ref": "http://example.com/s.json"}).grammar_object()
