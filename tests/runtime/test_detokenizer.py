"""Incremental detokenization (byte-level BPE, special tokens) and stop handling."""

import random

import pytest
from transformers import AutoTokenizer

from llmc.runtime.detokenizer import IncrementalDetokenizer, StopStatus, check_stop
from llmc.runtime.sampling_params import RequestOutputKind, SamplingParams

BOS, EOS, IM_START, IM_END = 0, 1, 2, 3
TEXTS = [
    "Hello café, naïve résumé! 😀🎉 日本語のテキスト and 中文 too.",
    "Ünïcödé everywhere: ñ ç ß ø 🙂 漢字かな 한국어 👍🏽 end",
]


@pytest.fixture(scope="module")
def tokenizer(ref_model_dir):
    return AutoTokenizer.from_pretrained(ref_model_dir)


def stream(tokenizer, token_ids, params, prompt=(BOS,), chunk=1, **kwargs):
    """Feed `token_ids` `chunk` at a time; return (detokenizer, deltas). Ends by length if open."""
    detok = IncrementalDetokenizer(tokenizer, list(prompt), params, **kwargs)
    deltas = [detok.add_tokens(token_ids[i : i + chunk]) for i in range(0, len(token_ids), chunk)]
    if not detok.is_finished:
        deltas.append(detok.finish("length"))
    assert "".join(deltas) == detok.output_text
    return detok, deltas


def open_params(**kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=None, **kwargs)


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_of_multibyte_text_concatenate_to_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    detok, deltas = stream(tokenizer, ids, open_params())
    assert detok.output_text == text == tokenizer.decode(ids)
    assert not any("\ufffd" in delta for delta in deltas)  # nothing emitted mid-character


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY])  # FINAL_ONLY: decoded at the end
@pytest.mark.parametrize("seed", range(6))
def test_random_token_sequences_match_decode(tokenizer, seed, kind):
    rng = random.Random(seed)
    vocab = rng.sample(range(5, len(tokenizer)), 600) + [IM_START, IM_END, EOS, BOS]
    ids = [rng.choice(vocab) for _ in range(rng.randint(1, 80))]
    text_ids = tokenizer.encode(rng.choice(TEXTS), add_special_tokens=False)
    ids[rng.randint(0, len(ids)) :] = text_ids + ids[rng.randint(0, len(ids)) :]
    chunk = rng.choice([1, 1, 2, 3])
    params = open_params(ignore_eos=True, output_kind=kind)
    detok, _ = stream(tokenizer, ids, params, chunk=chunk)
    assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=True)
    kept = open_params(ignore_eos=True, skip_special_tokens=False,
                       spaces_between_special_tokens=False, output_kind=kind)
    detok, _ = stream(tokenizer, ids, kept, chunk=chunk)
    assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=False)


def test_spaces_between_special_tokens(tokenizer):
    user = tokenizer.encode("user\nhi", add_special_tokens=False)
    ids = [IM_START] + user + [IM_END, IM_START]
    params = open_params(skip_special_tokens=False)
    assert stream(tokenizer, ids, params)[0].output_text == (
        "<|im_start|> user\nhi <|im_end|> <|im_start|>")
    params = open_params(skip_special_tokens=False, spaces_between_special_tokens=False)
    expected = "<|im_start|>user\nhi<|im_end|><|im_start|>"
    assert stream(tokenizer, ids, params)[0].output_text == expected
    assert stream(tokenizer, ids, open_params())[0].output_text == "user\nhi"


def test_stop_string_split_across_tokens_is_caught_and_held_back(tokenizer):
    text = "The answer is 42. THE END of the story"
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop = "THE END"
    assert stop not in [tokenizer.decode([t]) for t in ids]  # really split
    detok, deltas = stream(tokenizer, ids, open_params(stop=["nope", stop]))
    assert detok.output_text == "The answer is 42. "
    assert detok.status == StopStatus("stop", stop)
    streamed = ""
    for delta in deltas:  # a stream never shows text that is retracted later
        streamed += delta
        assert detok.output_text.startswith(streamed)
    assert len(detok.output_token_ids) < len(ids)  # later tokens ignored


def test_stop_string_inside_multibyte_text(tokenizer):
    text = TEXTS[0]
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok, _ = stream(tokenizer, ids, open_params(stop="語の"), chunk=2)
    assert detok.output_text == text[: text.index("語の")]
    assert detok.stop_reason == "語の"


def test_include_stop_str_in_output(tokenizer):
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    detok, _ = stream(tokenizer, ids, open_params(stop=["thr"], include_stop_str_in_output=True))
    assert detok.output_text == "one two thr" and detok.stop_reason == "thr"


def test_unmatched_stop_prefix_is_released(tokenizer):
    ids = tokenizer.encode("a THE ENDLESS b", add_special_tokens=False)
    detok, _ = stream(tokenizer, ids[:-2], open_params(stop="THE ENDX"))
    assert detok.output_text == tokenizer.decode(ids[:-2])
    assert detok.finish_reason == "length" and detok.stop_reason is None


def test_eos_and_stop_tokens_end_without_text(tokenizer):
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    detok, _ = stream(tokenizer, ids + [EOS] + ids, open_params(skip_special_tokens=False))
    assert detok.output_text == "hello world" and detok.status == StopStatus("stop", None)
    assert detok.output_token_ids == ids + [EOS]
    detok, _ = stream(tokenizer, ids + ids, open_params(stop_token_ids=[ids[1]]))
    assert detok.output_text == tokenizer.decode(ids[:1]) and detok.stop_reason == ids[1]
    detok, _ = stream(tokenizer, ids + ids, open_params(stop_token_ids=[ids[1]],
                                                        include_stop_str_in_output=True))
    assert detok.output_text == tokenizer.decode(ids[:2])
    detok, _ = stream(tokenizer, ids + [EOS] + ids, open_params(ignore_eos=True))
    assert detok.output_text == "hello worldhello world" and detok.finish_reason == "length"


def test_min_tokens_delays_stops(tokenizer):
    ids = tokenizer.encode("ab ab ab", add_special_tokens=False)
    # Everything before the last eos is within min_tokens: neither eos nor "ab" stops it.
    params = open_params(min_tokens=len(ids) + 1, stop="ab", stop_token_ids=[EOS])
    detok, _ = stream(tokenizer, [EOS] + ids + [EOS], params)
    assert detok.status == StopStatus("stop", None)
    assert detok.output_text == "ab ab ab" and len(detok.output_token_ids) == len(ids) + 2
    # The first token after min_tokens completes "ab": the text is cut there.
    detok, _ = stream(tokenizer, ids + [ids[1]] + ids, open_params(min_tokens=len(ids), stop="ab"))
    assert detok.output_text == "ab ab ab " and detok.stop_reason == "ab"
    assert len(detok.output_token_ids) == len(ids) + 1


def test_length_limits(tokenizer):
    ids = tokenizer.encode("one two three four five", add_special_tokens=False)
    detok, _ = stream(tokenizer, ids, SamplingParams(max_tokens=2))
    assert detok.output_token_ids == ids[:2] and detok.finish_reason == "length"
    detok, _ = stream(tokenizer, ids, open_params(), prompt=[BOS, 7, 8], max_model_len=6)
    assert len(detok.output_token_ids) == 3 and detok.finish_reason == "length"


def test_abort_flushes_held_back_text(tokenizer):
    ids = tokenizer.encode("wait for it", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [BOS], open_params(stop="it!"))
    streamed = detok.add_tokens(ids)
    assert streamed == "wait for "  # "it" may start the stop string
    assert detok.finish() == "it" and detok.finish_reason == "abort"


def test_detokenize_false_needs_no_tokenizer():
    detok = IncrementalDetokenizer(None, [BOS], SamplingParams(detokenize=False, max_tokens=3),
                                   eos_token_ids=[EOS])
    assert detok.add_tokens([5, 6]) == "" and not detok.is_finished
    assert detok.add_tokens([EOS, 9]) == "" and detok.status == StopStatus("stop", None)
    assert detok.output_token_ids == [5, 6, EOS]


def test_check_stop():
    params = SamplingParams(stop_token_ids=[9], min_tokens=1, max_tokens=4)
    assert check_stop(params, [EOS], [EOS]) is None  # min_tokens
    assert check_stop(params, [5, EOS], [EOS]) == StopStatus("stop", None)
    assert check_stop(params, [5, 9], [EOS]) == StopStatus("stop", 9)
    assert check_stop(params, [5, 6, 7, 8], [EOS]) == StopStatus("length")
    assert check_stop(params, [5, 6, 7, EOS], [EOS]) == StopStatus("stop", None)
    assert check_stop(params.replace(ignore_eos=True), [5, EOS], [EOS]) is None
    assert check_stop(params, [5], [EOS], num_prompt_tokens=9, max_model_len=10).finish_reason == (
        "length")
