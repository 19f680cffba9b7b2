"""How one request is sampled and when it stops: `SamplingParams`, vLLM's fields and defaults.

A plain dataclass: `SamplingParams(temperature=0, max_tokens=8)` works. `__post_init__` validates
every field (a bad value raises `RequestError` naming the field and what is allowed) and
normalizes a few for the sampler: `stop` becomes a list, `stop_token_ids` a list, `top_k=-1`
becomes 0 (both mean "off"), `logit_bias` keys become ints (JSON sends strings).
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from llmc.errors import RequestError
from llmc.runtime.tokenizer import is_unicode_text

# Temperatures below this are greedy: dividing logits by them overflows float32, and a
# distribution that sharp is argmax anyway. The same threshold as vLLM.
GREEDY_TEMPERATURE_EPS = 1e-5
# OpenAI's (and vLLM's) range for a logit bias.
MAX_ABS_LOGIT_BIAS = 100.0  # the server clamps logit_bias to this, as vLLM's
MAX_SAFE_LOGIT_BIAS = 1e9  # SamplingParams clamps to this: dominates any logit, finite over any temperature
# torch.Generator.manual_seed accepts seeds in [-2**63, 2**64).
_SEED_RANGE = (-(2**63), 2**64 - 1)
_INT64_MAX = 2**63 - 1

class RequestOutputKind(enum.Enum):
    """Which outputs `Engine.step()` returns for a request (vLLM's enum and values).

    CUMULATIVE: after every step, the whole output so far (text, token ids, logprobs).
    DELTA: after every step that added to a sequence, only what was added since the last output
        (its text, token ids and logprobs; `cumulative_logprob` stays the running sum); prompt
        logprobs come with the first output only.
    FINAL_ONLY: one output, when the request is finished (what `LLM.generate` asks for). No output
        is built for the steps before: the cheapest for the host.
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


LogitsProcessor = Callable[..., Any]
"""A per-request logits processor, in one of two forms (vLLM's):

    (output_token_ids, logits) -> logits
    (prompt_token_ids, output_token_ids, logits) -> logits

`logits` is one row, `[vocab_size]`; the processor returns a tensor of the same shape (it may
modify its argument in place and return it)."""


@dataclass
class SamplingParams:
    """Sampling and stopping parameters of one request (vLLM's names, defaults and ranges).

    Fields:
        n: number of output sequences returned for the prompt.
        best_of: number of sequences generated, the best `n` returned; None means `n`.
        presence_penalty: subtracted once from the logit of every token already in the output.
        frequency_penalty: subtracted from a token's logit once per occurrence in the output.
        repetition_penalty: tokens already in the prompt or output have positive logits divided
            by it and negative logits multiplied by it (1 = off).
        temperature: logits are divided by it; below 1e-5 sampling is greedy (argmax).
        top_p: keep the smallest set of most likely tokens whose probability sums to >= top_p.
        top_k: keep the k most likely tokens; 0 (or -1, stored as 0) means all.
        min_p: drop tokens whose probability is below min_p times the most likely token's.
        seed: per-request seed; the same seed gives the same tokens whatever else is batched.
        stop: strings that end generation; the output is cut before the first match.
        stop_token_ids: token ids that end generation (besides eos).
        include_stop_str_in_output: keep the matched stop string (or stop token text) in the text.
        ignore_eos: keep generating after eos (eos is then an ordinary token).
        max_tokens: most tokens generated per sequence; None means up to the model's max length.
        min_tokens: tokens generated before eos, stop_token_ids or stop strings may end it.
        logprobs: number of most likely tokens whose logprobs are returned for each generated
            token; the sampled token's logprob is always included (0 = only it); -1: the whole
            vocabulary (as vLLM, where the engine's max_logprobs allows it). None = none.
        prompt_logprobs: the same for every prompt token.
        detokenize: produce text; False returns token ids only (and forbids `stop`).
        skip_special_tokens: leave special tokens out of the text.
        spaces_between_special_tokens: separate kept special tokens from neighbouring text by
            one space, with a slow (Python) tokenizer only; a fast tokenizer's text is its own
            decode of the tokens, which ignores it, as vLLM v1 does (runtime/detokenizer.py).
        logits_processors: callables applied to each row's logits first (see `LogitsProcessor`).
        truncate_prompt_tokens: keep only the last k prompt tokens (-1: the last max_model_len, vLLM's).
        logit_bias: token id -> value added to its logit (any finite value; the server clamps to [-100, 100], as vLLM's).
        allowed_token_ids: if set, every other token is masked out.
        bad_words: words never generated (vLLM's semantics: a word of several tokens is banned
            at its last token, once the others were just generated).
        guided_decoding: a `GuidedDecodingParams` (JSON schema, regex, choice, grammar) the output
            must follow; `structured_outputs` is vLLM's newer name for the same (give one).
        use_beam_search: beam search with beam width `n` (vLLM's field, as its OpenAI server takes
            it): the n best beams by cumulative logprob / length ** length_penalty are returned.
            Fields that cannot apply to it (stop strings, penalties, logprobs, ...) are refused.
        length_penalty: the exponent of the length in a beam's score (beam search only).
        output_kind: a `RequestOutputKind`: every step's whole output (CUMULATIVE), every step's
            new part (DELTA) or only the final output (FINAL_ONLY).
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logits_processors: list[LogitsProcessor] | None = None
    truncate_prompt_tokens: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    guided_decoding: Any = None
    structured_outputs: Any = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Derived in __post_init__: the number of arguments each logits processor takes (2 or 3).
    logits_processor_arities: list[int] = field(
        init=False, default_factory=list, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        # vLLM's normalizations: seed -1 is no seed (a random draw, as OpenAI clients mean it), and
        # logprobs / prompt_logprobs True ask for one top entry
        if _is_int(self.seed) and self.seed == -1:
            self.seed = None
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is True:
                setattr(self, name, 1)
        self._validate_counts()
        self._validate_sampling()
        self._validate_penalties()
        self._validate_stopping()
        self._validate_token_lists()
        self._validate_constraints()
        self._validate_beam_search()
        self.logits_processor_arities = [
            _logits_processor_arity(p) for p in (self.logits_processors or [])
        ]

    @property
    def is_greedy(self) -> bool:
        """Argmax sampling: temperature 0 (or below 1e-5, as in vLLM)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def changes_logits(self) -> bool:
        """Whether something acts on this request's logits before it samples, beyond temperature and the top-k / top-p
        / min-p filters: penalties, logit_bias, allowed_token_ids, min_tokens, logits processors. A greedy request
        without any takes the argmax of its raw logits (after grammar and bad-word masks, which the engine applies)."""
        return bool(self.has_penalties or self.logit_bias or self.allowed_token_ids is not None or self.min_tokens
                    or self.logits_processors)

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def all_stop_token_ids(self, eos_token_ids: Iterable[int]) -> set[int]:
        """Token ids that end this request: `stop_token_ids`, plus eos unless `ignore_eos`."""
        ids = set(self.stop_token_ids or ())
        if not self.ignore_eos:
            ids.update(eos_token_ids)
        return ids

    def clone(self) -> SamplingParams:
        """A copy whose lists and dicts can be changed without touching this one."""
        return self.replace()

    def replace(self, **changes: Any) -> SamplingParams:
        """A validated copy with `changes` applied (e.g. `params.replace(max_tokens=1)`)."""
        copied = {
            name: _shallow_copy(getattr(self, name))
            for name in ("stop", "stop_token_ids", "logits_processors", "logit_bias",
                         "allowed_token_ids", "bad_words")
        }
        copied["structured_outputs"] = None  # folded into guided_decoding
        return dataclasses.replace(self, **{**copied, **changes})

    def check_vocab(self, vocab_size: int) -> None:
        """Raise if a token id in the request is outside the model's vocabulary.

        The engine calls this when a request is added: the params alone do not know the vocab.
        """
        for name in ("stop_token_ids", "allowed_token_ids"):
            bad = [t for t in getattr(self, name) or () if t >= vocab_size]
            _require(not bad, name, f"token ids below the vocabulary size {vocab_size}", bad)
        bad = [t for t in self.logit_bias or {} if t >= vocab_size]
        _require(not bad, "logit_bias", f"token ids below the vocabulary size {vocab_size}", bad)

    # -- validation ------------------------------------------------------------------------

    def _validate_counts(self) -> None:
        _require(_is_int(self.n) and self.n >= 1, "n", "an integer >= 1", self.n)
        if self.best_of is not None:
            _require(
                _is_int(self.best_of) and self.best_of >= self.n,
                "best_of", f"an integer >= n ({self.n}) or None", self.best_of,
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(value is None or (_is_int(value) and value >= -1), name,
                     "an integer >= 0, -1 (the whole vocabulary) or None", value)
        value = self.truncate_prompt_tokens
        _require(value is None or (_is_int(value) and (value >= 1 or value == -1)), "truncate_prompt_tokens",
                 "an integer >= 1, -1 (max_model_len) or None", value)
        if self.seed is not None:
            lo, hi = _SEED_RANGE
            _require(_is_int(self.seed) and lo <= self.seed <= hi, "seed",
                     "an integer in [-2**63, 2**64) or None", self.seed)
        _require(isinstance(self.output_kind, RequestOutputKind), "output_kind",
                 "a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)", self.output_kind)
        _require(self.output_kind is not RequestOutputKind.DELTA or (self.best_of or self.n) == self.n,
                 "output_kind", f"CUMULATIVE or FINAL_ONLY when best_of ({self.best_of}) > n ({self.n}): "
                 "which sequences are returned is known only at the end", self.output_kind)

    def _validate_sampling(self) -> None:
        self.temperature = _as_float(self.temperature, "temperature")
        _require(self.temperature >= 0.0, "temperature", "a number >= 0 (0 = greedy)",
                 self.temperature)
        self.top_p = _as_float(self.top_p, "top_p")
        _require(0.0 < self.top_p <= 1.0, "top_p", "a number in (0, 1]", self.top_p)
        _require(_is_int(self.top_k) and -1 <= self.top_k <= _INT64_MAX, "top_k",
                 "an integer in [1, 2**63), or 0 or -1 for no limit", self.top_k)
        if self.top_k == -1:
            self.top_k = 0
        self.min_p = _as_float(self.min_p, "min_p")
        _require(0.0 <= self.min_p <= 1.0, "min_p", "a number in [0, 1]", self.min_p)
        if self.is_greedy and not self.use_beam_search:
            # Several greedy samples of one prompt would all be identical.
            _require(self.n == 1, "n", "1 with greedy sampling (temperature 0)", self.n)
            _require((self.best_of or 1) == 1, "best_of", "1 or None with greedy sampling (temperature 0)",
                     self.best_of)

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(getattr(self, name), name)
            _require(-2.0 <= value <= 2.0, name, "a number in [-2, 2]", value)
            setattr(self, name, value)
        self.repetition_penalty = _as_float(self.repetition_penalty, "repetition_penalty")
        _require(self.repetition_penalty > 0.0, "repetition_penalty",
                 "a number > 0 (1 = off)", self.repetition_penalty)

    def _validate_stopping(self) -> None:
        if self.max_tokens is not None:
            _require(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
                     "an integer >= 1 or None", self.max_tokens)
        _require(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
                 "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None:
            _require(self.min_tokens <= self.max_tokens, "min_tokens",
                     f"at most max_tokens ({self.max_tokens})", self.min_tokens)
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        _require(all(isinstance(s, str) and s for s in stop), "stop",
                 "a non-empty string or a list of non-empty strings", self.stop)
        _require(all(is_unicode_text(s) for s in stop), "stop", "Unicode text (a lone UTF-16 surrogate is not)", self.stop)
        _require(not stop or self.detokenize, "stop",
                 "empty when detokenize=False (stop strings need text)", self.stop)
        self.stop = stop

    def _validate_token_lists(self) -> None:
        self.stop_token_ids = _token_ids(self.stop_token_ids, "stop_token_ids", allow_empty=True)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids(
                self.allowed_token_ids, "allowed_token_ids", allow_empty=False
            )
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        processors = self.logits_processors
        _require(processors is None or all(callable(p) for p in processors),
                 "logits_processors", "a list of callables", processors)

    def _validate_constraints(self) -> None:
        from llmc.runtime.structured_output import GuidedDecodingParams

        words = self.bad_words
        _require(words is None or (isinstance(words, list) and all(isinstance(w, str) and w.strip() for w in words)),
                 "bad_words", "a list of non-empty strings or None", words)
        _require(all(is_unicode_text(w) for w in words or []), "bad_words", "Unicode text (a lone UTF-16 surrogate is not)",
                 words)
        if self.structured_outputs is not None:
            _require(self.guided_decoding is None, "structured_outputs",
                     "None when guided_decoding is given (they are the same setting)", self.structured_outputs)
            self.guided_decoding, self.structured_outputs = self.structured_outputs, None
        _require(self.guided_decoding is None or isinstance(self.guided_decoding, GuidedDecodingParams),
                 "guided_decoding", "a GuidedDecodingParams or None", self.guided_decoding)

    def _validate_beam_search(self) -> None:
        _require(isinstance(self.use_beam_search, bool), "use_beam_search", "True or False", self.use_beam_search)
        self.length_penalty = _as_float(self.length_penalty, "length_penalty")
        if not self.use_beam_search:
            _require(self.length_penalty == 1.0, "length_penalty", "1.0 unless use_beam_search is True "
                     "(only beam search scores by length)", self.length_penalty)
            return
        _require(self.best_of in (None, self.n), "best_of",
                 f"None or n ({self.n}) with use_beam_search (n is the beam width)", self.best_of)
        defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
        for name in _NOT_WITH_BEAM_SEARCH:
            value = getattr(self, name)
            if value not in (None, [], {}) and value != defaults[name]:
                raise RequestError(f"SamplingParams.{name} does not apply to beam search (use_beam_search=True); "
                                   "leave it unset")


# What beam search cannot honour: it ranks beams by the model's raw logprobs and ends a beam at eos only.
_NOT_WITH_BEAM_SEARCH = ("presence_penalty", "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids",
                         "min_tokens", "logprobs", "prompt_logprobs", "logits_processors", "logit_bias",
                         "allowed_token_ids", "bad_words", "guided_decoding")


def _require(condition: bool, name: str, allowed: str, value: Any) -> None:
    if not condition:
        raise RequestError(f"SamplingParams.{name} must be {allowed}, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _as_float(value: Any, name: str) -> float:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    _require(is_number and math.isfinite(value), name, "a finite number", value)
    return float(value)


def _token_ids(ids: Any, name: str, *, allow_empty: bool) -> list[int]:
    ids = list(ids or [])
    _require(all(_is_int(t) and t >= 0 for t in ids), name, "a list of token ids >= 0", ids)
    _require(allow_empty or ids, name, "a non-empty list of token ids, or None", ids)
    return ids


def _logit_bias(bias: Any) -> dict[int, float]:
    _require(isinstance(bias, dict), "logit_bias", "a dict of token id -> bias", bias)
    parsed: dict[int, float] = {}
    for key, value in bias.items():
        # JSON object keys are strings: accept "42" as token 42.
        # ASCII digits only: str.isdigit() accepts "²", which int() refuses.
        is_id = _is_int(key) or (isinstance(key, str) and key.strip().isascii() and key.strip().isdigit())
        _require(is_id and int(key) >= 0, "logit_bias", "keyed by token ids >= 0", key)
        # any finite value, as vLLM's (its server clamps to 100), held to what float32 logits divided by
        # a temperature keep finite: beyond 1e9 they overflowed to inf and sampled NaN
        parsed[int(key)] = max(-MAX_SAFE_LOGIT_BIAS, min(MAX_SAFE_LOGIT_BIAS, _as_float(value, "logit_bias")))
    return parsed


def _logits_processor_arity(processor: LogitsProcessor) -> int:
    """2 for vLLM's `(output_ids, logits)`, 3 for `(prompt_ids, output_ids, logits)`."""
    try:
        parameters = inspect.signature(processor).parameters.values()
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        return 2
    positional = [
        p for p in parameters
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]
    has_varargs = any(p.kind is p.VAR_POSITIONAL for p in parameters)
    if len(positional) in (2, 3):
        return len(positional)
    _require(has_varargs and len(positional) < 2, "logits_processors",
             "callables taking (output_token_ids, logits) or "
             "(prompt_token_ids, output_token_ids, logits)", processor)
    return 2


def _shallow_copy(value: Any) -> Any:
    if isinstance(value, (list, dict)):
        return type(value)(value)
    return value
