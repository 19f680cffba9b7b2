"""Incremental detokenization and stop handling: token ids in, stream-safe text deltas out.

NOTE (algorithm): text is decoded incrementally with vLLM's prefix/read offsets: each new token
decodes a short window (the tokens of the last emitted chunk plus the new ones) and emits what
the window gained. Byte-level BPE splits a multi-byte UTF-8 character across tokens, and a window
ending mid-character decodes to a trailing U+FFFD; such text is held back until the character
completes (or the request ends, when the replacement character is final, as in a full decode).

Fast tokenizers (Hugging Face's, on the Rust `tokenizers` library): the window runs over all tokens,
special ones included, seeded with the prompt's last tokens, and each decode is the backend's with
`skip_special_tokens` as requested. This is what `tokenizers.decoders.DecodeStream` (vLLM v1's
fast-tokenizer detokenizer) does: the text equals the full decode of prompt and output, less the
prompt's text, so decoders that strip the text's first space (Llama-2's `Strip`, `Metaspace`) keep the
space after a kept special token, and spaces_between_special_tokens is ignored, as it is by vLLM v1
and by the fast tokenizer's own `decode`.

Other (slow, Python) tokenizers: special tokens split the output into pieces ("normal" runs of
tokens and kept special tokens), each decoded on its own, as vLLM's slow path (and transformers 4's
slow tokenizers) do; with skip_special_tokens they are dropped (and do not split a run), otherwise
their text is kept and, with spaces_between_special_tokens, one space separates consecutive pieces.

Stop strings are searched in the decoded text after every token (once `min_tokens` outputs
exist); the output is cut at the first match. Until then, the longest tail of the text that is
still the start of some stop string is held back from the stream, so a streaming client never
sees text that is later retracted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Iterable, Literal

from llmc.runtime.sampling_params import RequestOutputKind, SamplingParams

# Prompt tokens that seed the first window, so that the first output token decodes as it does
# in context (sentencepiece-style decoders drop a leading space at the start of a text).
# vLLM v1 seeds its DecodeStream with 4 or more.
NUM_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True)
class StopStatus:
    """Why a request finished.

    Fields:
        finish_reason: "stop" (eos, a stop token or a stop string) or "length" (max_tokens or
            max_model_len reached), or what the engine passed to `finish` (e.g. "abort").
        stop_reason: the stop token id or the matched stop string; None for the model's eos (the first
            of eos_token_ids) and length; another end token's id (a generation config's, as vLLM).
    """

    finish_reason: Literal["stop", "length"] | str
    stop_reason: int | str | None = None


def check_stop(
    params: SamplingParams,
    output_token_ids: list[int],
    eos_token_ids: Sequence[int],
    *,
    num_prompt_tokens: int = 0,
    max_model_len: int | None = None,
) -> StopStatus | None:
    """Whether the last token ended the request, by token alone (stop strings need text).

    Eos (unless ignore_eos) and stop_token_ids count only once more than `min_tokens` outputs
    exist: the sampler masks them for the first `min_tokens` tokens, so the earliest stop token
    is output number min_tokens + 1. A stop token wins over a length limit reached by the same
    token (so its text is left out).
    """
    num_outputs = len(output_token_ids)
    if num_outputs > params.min_tokens:
        last = output_token_ids[-1]
        if not params.ignore_eos and last in eos_token_ids:
            # the model's eos (the first) has no stop reason; another end token (a generation config's) is
            # a stop token id in vLLM, and reports itself
            return StopStatus("stop", None if last == eos_token_ids[0] else last)
        if last in params.stop_token_ids:
            return StopStatus("stop", last)
    if params.max_tokens is not None and num_outputs >= params.max_tokens:
        return StopStatus("length")
    if max_model_len is not None and num_prompt_tokens + num_outputs >= max_model_len:
        return StopStatus("length")
    return None


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text, and decides when it stops.

    Use: `delta = detok.add_tokens(new_ids)` after every step, stream `delta`, and stop
    scheduling the sequence once `detok.is_finished`; `finish()` ends it for other reasons
    (abort). `output_text` is always the concatenation of all deltas returned so far.

    `output_token_ids` holds the tokens up to the one that finished the request; tokens passed
    after that (e.g. the rest of a speculative batch) are ignored.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        eos_token_ids: Iterable[int] | None = None,
        max_model_len: int | None = None,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """`tokenizer` may be None when `params.detokenize` is False.

        `eos_token_ids` defaults to the tokenizer's eos token; pass the model's (e.g. from
        generation_config) when it has several. `num_prompt_tokens` (for max_model_len) defaults to
        len(prompt_token_ids); a prompt given as embeddings passes no ids, and its length.
        """
        self.params = params
        self.output_token_ids: list[int] = []
        self.status: StopStatus | None = None
        if eos_token_ids is None:
            eos_id = getattr(tokenizer, "eos_token_id", None)
            eos_token_ids = [] if eos_id is None else [eos_id]
        self._eos_token_ids = list(eos_token_ids)  # the model's eos first (check_stop)
        self._num_prompt_tokens = len(prompt_token_ids) if num_prompt_tokens is None else num_prompt_tokens
        self._max_model_len = max_model_len
        self._text = ""  # decoded text, including the held-back tail
        self._num_emitted = 0  # characters of _text returned as deltas
        self._max_stop_len = max((len(s) for s in params.stop), default=0)
        self._pieces: _StreamDecoder | _PieceJoiner | None = None
        if params.detokenize:
            self._pieces = _text_decoder(tokenizer, prompt_token_ids, params)
        # FINAL_ONLY without stop strings: nothing reads the text before the end, so the tokens are
        # decoded then, each run in one window, instead of two window decodes per token.
        self._deferred: list[int] | None = None
        if params.output_kind is RequestOutputKind.FINAL_ONLY and not params.stop and self._pieces is not None:
            self._deferred = []
            self._decoder_args = (tokenizer, prompt_token_ids)  # to decode the tokens again (_flush)

    @property
    def output_text(self) -> str:
        """The text streamed so far (all deltas); the whole output once finished."""
        return self._text[: self._num_emitted]

    @property
    def num_output_chars(self) -> int:
        return self._num_emitted

    def output_text_from(self, start: int) -> str:
        """`output_text[start:]`, without copying what comes before."""
        return self._text[start : self._num_emitted]

    @property
    def is_finished(self) -> bool:
        return self.status is not None

    @property
    def finish_reason(self) -> str | None:
        return None if self.status is None else self.status.finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return None if self.status is None else self.status.stop_reason

    def add_tokens(self, new_token_ids: Iterable[int]) -> str:
        """Append generated tokens; return the text that became final (the stream delta)."""
        for token_id in new_token_ids:
            if self.status is not None:
                break
            self._add_token(token_id)
        if self._deferred is not None and self.status is None:
            return ""  # nothing is decoded before the end
        return self._emit()

    def finish(self, finish_reason: str = "abort") -> str:
        """End the sequence for a reason of the engine's; return the last delta."""
        if not self.is_finished:
            num_chars = len(self._text)
            self._flush()
            self.status = self._match_stop_string(num_chars) or StopStatus(finish_reason)
        return self._emit()

    def _add_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        status = check_stop(
            self.params, self.output_token_ids, self._eos_token_ids,
            num_prompt_tokens=self._num_prompt_tokens, max_model_len=self._max_model_len,
        )
        is_stop_token = status is not None and status.finish_reason == "stop"
        num_chars = len(self._text)
        if self._pieces is not None and (not is_stop_token
                                         or self.params.include_stop_str_in_output):
            if self._deferred is not None:
                self._deferred.append(token_id)
            else:
                self._text += self._pieces.add(token_id)
        if status is not None:
            self._flush()  # bytes still pending are final now
        if not is_stop_token:
            status = self._match_stop_string(num_chars) or status
        self.status = status

    def _flush(self) -> None:
        if self._pieces is None:
            return
        if not self._deferred:
            self._text += self._pieces.flush()
            return
        text = self._pieces.add_many(self._deferred) + self._pieces.flush()
        if _REPLACEMENT_CHAR in text:
            # A byte-fallback decoder (Llama-2, Mistral) decodes a window's byte tokens all or none: one
            # character cut by max_tokens made every byte-coded character before it U+FFFD. Decoded as
            # the stream decodes them, token by token, only the cut one is.
            pieces = _text_decoder(*self._decoder_args, self.params)
            text = "".join(pieces.add(token_id) for token_id in self._deferred) + pieces.flush()
        self._text += text
        self._deferred.clear()

    def _match_stop_string(self, num_old_chars: int) -> StopStatus | None:
        """Find a stop string ending in the text added after `num_old_chars`; cut the text there."""
        if not self.params.stop or len(self.output_token_ids) <= self.params.min_tokens:
            return None
        match: tuple[int, str] | None = None
        for stop in self.params.stop:
            index = self._text.find(stop, max(0, num_old_chars - len(stop) + 1))
            if index >= 0 and (match is None or index < match[0]):
                match = (index, stop)
        if match is None:
            return None
        index, stop = match
        end = index + len(stop) if self.params.include_stop_str_in_output else index
        # Holding back possible stop prefixes guarantees the cut is after the streamed text.
        assert end >= self._num_emitted, "stop string overlaps text already streamed"
        self._text = self._text[:end]
        return StopStatus("stop", stop)

    def _emit(self) -> str:
        end = len(self._text)
        if not self.is_finished:
            end -= self._num_chars_held_back()
        delta = self._text[self._num_emitted : end]
        self._num_emitted = max(self._num_emitted, end)
        return delta

    def _num_chars_held_back(self) -> int:
        """Length of the longest unstreamed tail that a stop string may still start with."""
        if self.params.include_stop_str_in_output or not self._max_stop_len:
            return 0  # the cut is at the end of the match (or no stop strings): nothing is ever retracted
        num_pending = len(self._text) - self._num_emitted
        for length in range(min(self._max_stop_len - 1, num_pending), 0, -1):
            tail = self._text[-length:]
            if any(stop.startswith(tail) for stop in self.params.stop):
                return length
        return 0


def _text_decoder(tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
    """The incremental decoder for `tokenizer`: `_StreamDecoder` for a fast one, else `_PieceJoiner`."""
    if _is_fast(tokenizer):
        return _StreamDecoder(tokenizer, prompt_token_ids, params)
    return _PieceJoiner(tokenizer, prompt_token_ids, params)


class _StreamDecoder:
    """Fast tokenizers: every token, special or not, goes through one `_RunDecoder` window decoded with
    the requested skip_special_tokens (DecodeStream's semantics; spaces_between_special_tokens is
    ignored, as the fast tokenizer's decode ignores it)."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
        skip = params.skip_special_tokens
        backend = _plain_backend(tokenizer)
        if backend is not None:  # what the tokenizer's decode does, without its wrapping and cleanup
            def decode(token_ids: list[int]) -> str:
                return backend.decode(token_ids, skip_special_tokens=skip)
        else:
            def decode(token_ids: list[int]) -> str:
                # No cleanup: clean_up_tokenization_spaces is not stable under appending tokens.
                return tokenizer.decode(token_ids, skip_special_tokens=skip,
                                        clean_up_tokenization_spaces=False)
        # The prompt's last tokens, special ones included (the decoder sees them in a full decode),
        # less any that end it mid-character: their bytes would merge with the output's.
        context = list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:])
        while context and decode(context).endswith(_REPLACEMENT_CHAR):
            context.pop()
        self._run = _RunDecoder(decode, context)

    def add(self, token_id: int) -> str:
        return self._run.add([token_id])

    def add_many(self, token_ids: list[int]) -> str:
        return self._run.add(token_ids) if token_ids else ""

    def flush(self) -> str:
        return self._run.flush()


class _PieceJoiner:
    """Slow tokenizers: splits the tokens into pieces at kept special tokens and joins their text."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
        self._tokenizer = tokenizer
        self._params = params
        self._special_ids = _special_token_ids(tokenizer)
        self._has_piece = False  # some piece exists: the next one gets the separator
        self._run: _RunDecoder | None = _RunDecoder(self._decode, self._prompt_context(
            prompt_token_ids))
        self._run_is_piece = False

    def add(self, token_id: int) -> str:
        """The text that `token_id` makes final (possibly empty)."""
        if token_id in self._special_ids:
            if self._params.skip_special_tokens:
                return ""  # dropped, and the run around it continues
            text = self.flush() + self._separator()
            return text + self._tokenizer.convert_ids_to_tokens(token_id)
        return self._add_to_run([token_id])

    def add_many(self, token_ids: list[int]) -> str:
        """`add` of each token in turn, with each run of normal tokens decoded in one window."""
        text, run = "", []
        for token_id in token_ids:
            if token_id not in self._special_ids:
                run.append(token_id)
            elif not self._params.skip_special_tokens:
                text += self._add_to_run(run) + self.add(token_id)
                run = []
        return text + self._add_to_run(run)

    def _add_to_run(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        text = ""
        if self._run is None:
            self._run = _RunDecoder(self._decode, [])
        if not self._run_is_piece:
            text = self._separator()
            self._run_is_piece = True
        return text + self._run.add(token_ids)

    def flush(self) -> str:
        """End the current run: its pending bytes become final (as replacement characters)."""
        text = self._run.flush() if self._run is not None else ""
        self._run, self._run_is_piece = None, False
        return text

    def _separator(self) -> str:
        text = " " if self._has_piece and self._params.spaces_between_special_tokens else ""
        self._has_piece = True
        return text

    def _decode(self, token_ids: list[int]) -> str:
        # No cleanup: clean_up_tokenization_spaces is not stable under appending tokens.
        return self._tokenizer.decode(
            token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def _prompt_context(self, prompt_token_ids: list[int]) -> list[int]:
        """The prompt's last few tokens after its last special token, if they decode cleanly."""
        context: list[int] = []
        for token_id in reversed(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:]):
            if token_id in self._special_ids:
                break
            context.insert(0, token_id)
        if context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            return []  # the prompt ends mid-character: decoding from there would be wrong
        return context


class _RunDecoder:
    """Incremental decoding of a run of tokens with prefix/read offsets.

    `_token_ids[:_read_offset]` is the last emitted chunk (decoded for context; its text is cached
    until the next chunk is emitted), `_token_ids[_read_offset:]` the tokens whose text is not final
    yet. A token costs one decode while its text is held back, two when a chunk is emitted.
    """

    def __init__(self, decode, context_token_ids: list[int]):
        self._decode = decode
        self._token_ids = list(context_token_ids)
        self._read_offset = len(self._token_ids)
        self._prefix_text: str | None = None  # decode of _token_ids[:_read_offset], once needed

    def add(self, token_ids: list[int]) -> str:
        self._token_ids += token_ids
        prefix_text, new_text = self._decode_window()
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""  # an incomplete character (or nothing yet): wait for more tokens
        self._next_chunk()
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        if self._read_offset == len(self._token_ids):
            return ""  # every token's text is out already
        prefix_text, new_text = self._decode_window()
        self._next_chunk()
        return new_text[len(prefix_text) :]

    def _decode_window(self) -> tuple[str, str]:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._token_ids[: self._read_offset])
        return self._prefix_text, self._decode(self._token_ids)

    def _next_chunk(self) -> None:
        # The new chunk becomes the next window's context; older tokens are not needed.
        del self._token_ids[: self._read_offset]
        self._read_offset = len(self._token_ids)
        self._prefix_text = None


def _is_fast(tokenizer: Any) -> bool:
    """Whether `tokenizer` is a Hugging Face fast tokenizer (backed by the Rust `tokenizers`)."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return False
    return isinstance(tokenizer, PreTrainedTokenizerFast)


def _plain_backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` of a Hugging Face fast tokenizer whose class keeps the stock decode
    (so decoding without cleanup is exactly the backend's decode); None otherwise."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    if isinstance(tokenizer, PreTrainedTokenizerFast) and type(tokenizer)._decode is PreTrainedTokenizerFast._decode:
        return tokenizer.backend_tokenizer
    return None


def _special_token_ids(tokenizer: Any) -> set[int]:
    """Ids that skip_special_tokens drops: the declared specials and added tokens marked special."""
    ids = set(getattr(tokenizer, "all_special_ids", ()))
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(token_id for token_id, token in added.items() if getattr(token, "special", False))
    return ids
