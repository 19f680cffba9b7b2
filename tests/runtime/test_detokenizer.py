"""Incremental detokenization (byte-level BPE, a sentencepiece-style tokenizer, special tokens) and stop
handling, against Hugging Face's decode of the whole text and tokenizers' DecodeStream."""

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
    for spaces in (True, False):  # a fast tokenizer's decode ignores the flag, and so does vLLM v1
        kept = open_params(ignore_eos=True, skip_special_tokens=False,
                           spaces_between_special_tokens=spaces, output_kind=kind)
        detok, _ = stream(tokenizer, ids, kept, chunk=chunk)
        assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("spaces", [True, False])
def test_fast_tokenizer_ignores_spaces_between_special_tokens(tokenizer, spaces):
    bang = tokenizer.encode("!", add_special_tokens=False)
    user = tokenizer.encode("user\nhi", add_special_tokens=False)
    params = open_params(skip_special_tokens=False, spaces_between_special_tokens=spaces)
    ids = bang + [IM_END] + bang + [IM_END] + bang
    assert stream(tokenizer, ids, params)[0].output_text == "!<|im_end|>!<|im_end|>!" == (
        tokenizer.decode(ids, skip_special_tokens=False))
    ids = [IM_START] + user + [IM_END, IM_START]
    expected = "<|im_start|>user\nhi<|im_end|><|im_start|>"
    assert stream(tokenizer, ids, params)[0].output_text == expected == (
        tokenizer.decode(ids, skip_special_tokens=False))
    assert stream(tokenizer, ids, open_params(spaces_between_special_tokens=spaces))[0].output_text == (
        "user\nhi")


class SlowTokenizer:
    """A tokenizer that is not a fast one (as a Python tokenizer is): decodes through `tokenizer`."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.all_special_ids = tokenizer.all_special_ids
        self.added_tokens_decoder = tokenizer.added_tokens_decoder
        self.eos_token_id = tokenizer.eos_token_id

    def decode(self, token_ids, **kwargs):
        return self._tokenizer.decode(token_ids, **kwargs)

    def convert_ids_to_tokens(self, token_id):
        return self._tokenizer.convert_ids_to_tokens(token_id)


def test_slow_tokenizer_honours_spaces_between_special_tokens(tokenizer):
    """vLLM's slow-tokenizer path joins the pieces around kept special tokens with spaces."""
    user = tokenizer.encode("user\nhi", add_special_tokens=False)
    ids = [IM_START] + user + [IM_END, IM_START]
    slow = SlowTokenizer(tokenizer)
    params = open_params(skip_special_tokens=False)
    assert stream(slow, ids, params)[0].output_text == "<|im_start|> user\nhi <|im_end|> <|im_start|>"
    params = open_params(skip_special_tokens=False, spaces_between_special_tokens=False)
    assert stream(slow, ids, params)[0].output_text == "<|im_start|>user\nhi<|im_end|><|im_start|>"
    assert stream(slow, ids, open_params())[0].output_text == "user\nhi"


# A Llama-2/Mistral-style tokenizer: byte-fallback BPE over "▁"-marked words, whose decoder drops
# the first space of the text (Llama-2's Replace/ByteFallback/Fuse/Strip decoder, or a Metaspace
# pre-tokenizer and decoder), with special tokens <s>, </s>, [INST], [/INST].
SP_CORPUS = ["ok hi there fine", "[INST] hi there [/INST] fine, ok", "The answer is 42. THE END"] + TEXTS


@pytest.fixture(scope="module", params=["strip", "metaspace"])
def sp_tokenizer(request, tmp_path_factory):
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def with_style(tk):
        if request.param == "strip":
            tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
            tk.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                            decoders.Fuse(), decoders.Strip(" ", 1, 0)])
        else:
            tk.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
            tk.decoder = decoders.Sequence([decoders.Metaspace(prepend_scheme="first", split=False),
                                            decoders.ByteFallback(), decoders.Fuse()])
        return tk

    specials = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]
    trained = with_style(Tokenizer(models.BPE(unk_token="<unk>")))
    trained.train_from_iterator(SP_CORPUS, trainers.BpeTrainer(
        vocab_size=120, special_tokens=specials, show_progress=False))
    model = json.loads(trained.to_str())["model"]
    vocab = model["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tk = with_style(Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True,
                                         fuse_unk=True)))
    tk.add_special_tokens(specials)
    path = tmp_path_factory.mktemp("sp") / "tokenizer.json"
    tk.save(str(path))
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path), bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>")
    return request.param, tokenizer


def text_after_prompt(tokenizer, prompt, ids, skip_special_tokens):
    """What Hugging Face's decode of prompt + output adds to the prompt's text (no cleanup)."""
    def decode(token_ids):
        return tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens,
                                clean_up_tokenization_spaces=False)
    full, prompt_text = decode(list(prompt) + list(ids)), decode(list(prompt))
    assert full.startswith(prompt_text)
    return full[len(prompt_text) :]


def decode_stream(tokenizer, prompt, ids, skip_special_tokens):
    """What tokenizers' DecodeStream (vLLM v1's fast detokenizer) gives, primed with the prompt."""
    from tokenizers.decoders import DecodeStream

    decoder = DecodeStream(skip_special_tokens=skip_special_tokens)
    for token_id in prompt:
        decoder.step(tokenizer.backend_tokenizer, token_id)
    return "".join(decoder.step(tokenizer.backend_tokenizer, token_id) or "" for token_id in ids)


@pytest.mark.parametrize("spaces", [True, False])
def test_space_after_special_token_kept_with_sentencepiece_style_decoder(sp_tokenizer, spaces):
    style, tok = sp_tokenizer
    bos, inst = tok.convert_tokens_to_ids(["<s>", "[INST]"])
    ids = tok.encode("ok [INST] hi there [/INST] fine", add_special_tokens=False)
    assert inst in ids
    params = open_params(skip_special_tokens=False, spaces_between_special_tokens=spaces)
    # Llama-2's normalizer prepends "▁" to the text after a special token too: two spaces there.
    expected = {"strip": " ok [INST]  hi there [/INST]  fine",
                "metaspace": " ok [INST] hi there [/INST] fine"}[style]
    assert text_after_prompt(tok, [bos], ids, False) == expected == decode_stream(tok, [bos], ids, False)
    assert stream(tok, ids, params, prompt=[bos])[0].output_text == expected
    # The prompt ends with a special token: the first output token keeps its space too.
    prompt = [bos] + tok.encode("[INST] hi [/INST]", add_special_tokens=False)
    assert prompt[-1] == tok.convert_tokens_to_ids("[/INST]")
    ids = tok.encode("fine ok", add_special_tokens=False)
    assert text_after_prompt(tok, prompt, ids, False) == " fine ok" == decode_stream(tok, prompt, ids, False)
    assert stream(tok, ids, params, prompt=prompt)[0].output_text == " fine ok"
    skipped = open_params(spaces_between_special_tokens=spaces)
    assert stream(tok, ids, skipped, prompt=prompt)[0].output_text == text_after_prompt(
        tok, prompt, ids, True) == decode_stream(tok, prompt, ids, True)


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY])
@pytest.mark.parametrize("seed", range(4))
def test_sentencepiece_style_random_sequences_match_decode(sp_tokenizer, seed, kind):
    _, tok = sp_tokenizer
    rng = random.Random(seed)
    special = tok.convert_tokens_to_ids(["<s>", "</s>", "[INST]", "[/INST]"])
    words = [tok.encode(text, add_special_tokens=False) for text in SP_CORPUS + ["  a  b ", "日本"]]
    def sample(num_parts):
        ids = []
        for _ in range(num_parts):
            ids += [rng.choice(special)] if rng.random() < 0.3 else rng.choice(words)
        return ids
    prompt, ids = sample(rng.randint(1, 4)), sample(rng.randint(1, 8))
    chunk = rng.choice([1, 1, 2, 3])
    for skip in (True, False):
        for spaces in (True, False):
            params = open_params(ignore_eos=True, skip_special_tokens=skip,
                                 spaces_between_special_tokens=spaces, output_kind=kind)
            detok, deltas = stream(tok, ids, params, prompt=prompt, chunk=chunk)
            assert detok.output_text == text_after_prompt(tok, prompt, ids, skip)
            assert detok.output_text == decode_stream(tok, prompt, ids, skip)
            assert not any("\ufffd" in delta for delta in deltas)


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
def test_a_character_cut_by_the_length_limit_spoils_only_itself(sp_tokenizer, kind):
    """Byte-fallback tokens decode a run all or none: cut inside its last character (max_tokens),
    "猫犬" must keep 猫, as the stream decodes it and DecodeStream does, in a final-only request too
    (decoded in one window at the end, every byte of the run became U+FFFD)."""
    _, tok = sp_tokenizer
    ids = tok.encode("ok 猫犬", add_special_tokens=False)[:-1]  # byte tokens (not in its corpus); the last of 犬 missing
    detok, _ = stream(tok, ids, open_params(output_kind=kind))
    assert detok.output_text.startswith("ok 猫") and "猫" in decode_stream(tok, (BOS,), ids, True)


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
