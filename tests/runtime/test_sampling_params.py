"""SamplingParams: vLLM's defaults, validation that names the field, normalization, helpers."""

import pytest

from llmc.errors import LlmcError, RequestError
from llmc.runtime.sampling_params import SamplingParams


def test_defaults_match_vllm():
    params = SamplingParams()
    assert (params.n, params.best_of, params.temperature, params.top_p, params.top_k) == (
        1, None, 1.0, 1.0, 0)
    assert (params.min_p, params.seed, params.max_tokens, params.min_tokens) == (0.0, None, 16, 0)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        0.0, 0.0, 1.0)
    assert params.stop == [] and params.stop_token_ids == []
    assert params.logprobs is None and params.prompt_logprobs is None
    assert params.detokenize and params.skip_special_tokens
    assert params.spaces_between_special_tokens
    assert not params.include_stop_str_in_output and not params.ignore_eos
    assert not params.is_greedy and not params.has_penalties


def test_vllm_normalizations():
    """vLLM's SamplingParams reads seed -1 as no seed and logprobs / prompt_logprobs True as 1."""
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2
    params = SamplingParams(logprobs=True, prompt_logprobs=True)
    assert params.logprobs == 1 and params.prompt_logprobs == 1 and type(params.logprobs) is int


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("best_of", 1),  # with n=2 below
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.1),
        ("repetition_penalty", 0.0),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("min_tokens", 17),  # > max_tokens (16)
        ("logprobs", -2),  # -1: the whole vocabulary
        ("prompt_logprobs", -2),
        ("truncate_prompt_tokens", 0),
        ("seed", 2**64),
        ("seed", "7"),
        ("stop", [""]),
        ("stop", ["ok", 3]),
        ("stop", ["a\ud800"]),  # a lone surrogate: a str that is not Unicode text (could never match)
        ("bad_words", ["\ud800"]),  # the tokenizer raised its own TypeError
        ("stop_token_ids", [-1]),
        ("allowed_token_ids", []),
        ("logit_bias", {5: float("inf")}),  # any finite value, as vLLM's SamplingParams (its server clamps to 100)
        ("truncate_prompt_tokens", -2),  # -1: max_model_len
        ("logit_bias", {"x": 1.0}),
        ("logits_processors", [lambda logits: logits]),
        ("logits_processors", ["not callable"]),
    ],
)
def test_invalid_values_raise_request_error_naming_the_field(field, value):
    kwargs = {field: value}
    if field == "best_of":
        kwargs["n"] = 2
    with pytest.raises(RequestError, match=rf"SamplingParams\.{field} must be"):
        SamplingParams(**kwargs)


def test_greedy_sampling_names_the_field_that_asks_for_several_samples():
    with pytest.raises(RequestError, match=r"SamplingParams\.best_of must be 1 or None with greedy .*got 3"):
        SamplingParams(temperature=0, n=1, best_of=3)
    with pytest.raises(RequestError, match=r"SamplingParams\.n must be 1 with greedy .*got 2"):
        SamplingParams(temperature=0, n=2)


def test_request_error_is_an_llmc_error_and_a_value_error():
    """An llmc error (one line from the CLI) and, as vLLM's validation errors are, a ValueError."""
    with pytest.raises(LlmcError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"SamplingParams\.top_p"):
        SamplingParams(top_p=0)


def test_greedy_requires_a_single_sample():
    with pytest.raises(RequestError, match=r"SamplingParams\.n must be 1"):
        SamplingParams(temperature=0, n=2)


def test_stop_strings_need_detokenize():
    with pytest.raises(RequestError, match=r"SamplingParams\.stop .*detokenize"):
        SamplingParams(stop="x", detokenize=False)


def test_normalization():
    params = SamplingParams(top_k=-1, stop="###", logit_bias={"7": 2, 3: -1.5}, temperature=0,
                            max_tokens=None)
    assert params.top_k == 0
    assert params.stop == ["###"]
    assert params.logit_bias == {7: 2.0, 3: -1.5}
    assert isinstance(params.temperature, float) and params.is_greedy
    assert params.max_tokens is None


@pytest.mark.parametrize("temperature, is_greedy", [(0, True), (1e-6, True), (1e-4, False),
                                                    (0.7, False)])
def test_is_greedy(temperature, is_greedy):
    assert SamplingParams(temperature=temperature).is_greedy is is_greedy


def test_replace_validates_and_clone_is_independent():
    params = SamplingParams(stop=["a"], stop_token_ids=[5], logit_bias={1: 1.0})
    clone = params.clone()
    clone.stop.append("b")
    clone.logit_bias[2] = 3.0
    assert params.stop == ["a"] and params.logit_bias == {1: 1.0}
    assert clone == SamplingParams(stop=["a", "b"], stop_token_ids=[5],
                                   logit_bias={1: 1.0, 2: 3.0})
    assert params.replace(max_tokens=3).max_tokens == 3
    with pytest.raises(RequestError, match=r"SamplingParams\.top_p"):
        params.replace(top_p=0)


def test_logits_processor_arity():
    def two(output_ids, logits):
        return logits

    def three(prompt_ids, output_ids, logits):
        return logits

    def with_default(output_ids, logits, scale=1.0):
        return logits

    params = SamplingParams(logits_processors=[two, three, with_default])
    assert params.logits_processor_arities == [2, 3, 2]


def test_all_stop_token_ids_and_check_vocab():
    params = SamplingParams(stop_token_ids=[7, 8])
    assert params.all_stop_token_ids({1}) == {1, 7, 8}
    assert SamplingParams(stop_token_ids=[7], ignore_eos=True).all_stop_token_ids([1]) == {7}
    params.check_vocab(9)
    with pytest.raises(RequestError, match=r"SamplingParams\.stop_token_ids"):
        params.check_vocab(8)
    with pytest.raises(RequestError, match=r"SamplingParams\.logit_bias"):
        SamplingParams(logit_bias={100: 1.0}).check_vocab(50)
    with pytest.raises(RequestError, match=r"SamplingParams\.allowed_token_ids"):
        SamplingParams(allowed_token_ids=[3, 60]).check_vocab(50)


def test_truncate_prompt_tokens_minus_one_and_huge_logit_biases(ref_model_dir, tmp_path):
    """vLLM's truncate_prompt_tokens -1: the prompt's last max_model_len tokens (then no room is left
    for output: the context-length error, not a silently dropped first token). A logit_bias beyond
    float32's reach (vLLM's SamplingParams takes any value) still forces its token, at any temperature,
    rather than overflowing to inf and sampling NaN (token 0)."""
    from llmc.compiler.build import build
    from llmc.compiler.recipe import recipe_from_dict
    from llmc.runtime.llm import LLM

    out = tmp_path / "a"
    build(recipe_from_dict({"model": str(ref_model_dir), "output": str(out), "runtime": {"max_model_len": 64}}),
          show_progress=False)
    with LLM(out, disable_log_stats=True) as llm:
        prompt = list(range(10, 40))
        kept = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2, truncate_prompt_tokens=-1))
        assert kept[0].prompt_token_ids == prompt  # shorter than max_model_len: all kept
        with pytest.raises(RequestError, match="maximum context length|max_model_len"):
            llm.generate([{"prompt_token_ids": list(range(10, 110))}],
                         SamplingParams(max_tokens=2, truncate_prompt_tokens=-1))
        # a text prompt keeps its BOS, as the tokenizer's truncation from the left gives it (vLLM's)
        from transformers import AutoTokenizer
        reference = AutoTokenizer.from_pretrained(ref_model_dir)
        reference.truncation_side = "left"
        cut = llm.generate(["hello world foo bar"], SamplingParams(max_tokens=1, truncate_prompt_tokens=3))
        assert cut[0].prompt_token_ids == reference.encode("hello world foo bar", truncation=True, max_length=3)
        assert cut[0].prompt_token_ids[0] == reference.bos_token_id
        for bias, temperature in ((1e39, 1.0), (1e38, 0.1), (1e30, 1e-4)):
            forced = llm.generate([prompt], SamplingParams(max_tokens=3, logit_bias={57: bias}, temperature=temperature,
                                                           seed=1))
            assert forced[0].outputs[0].token_ids == [57, 57, 57]


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_text_truncation_is_transformers_left_truncation_without_touching_the_tokenizer(ref_model_dir,
                                                                                        add_special_tokens):
    """runtime/tokenizer.encode_text: what transformers' truncation from the left gives (vLLM's way of
    cutting a text prompt), for every k, and the shared tokenizer's truncation state left as it was."""
    from transformers import AutoTokenizer

    from llmc.runtime.tokenizer import encode_text

    ours, reference = AutoTokenizer.from_pretrained(ref_model_dir), AutoTokenizer.from_pretrained(ref_model_dir)
    reference.truncation_side = "left"
    before = ours.backend_tokenizer.truncation
    for text in ("hello world foo bar", "a", "ROMEO: I pray you, my lord, hear me speak"):
        for keep in range(1, 14):
            expected = reference.encode(text, add_special_tokens=add_special_tokens, truncation=True, max_length=keep)
            assert encode_text(ours, text, add_special_tokens, keep) == expected, (text, keep)
    assert ours.backend_tokenizer.truncation == before
