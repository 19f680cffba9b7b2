"""Structured output (guided decoding) and bad words: per-sequence token constraints.

NOTE (library): grammars are compiled and matched by xgrammar (vLLM's default backend; DESIGN §5
says why it was picked over llguidance). A `GuidedDecodingParams` names one constraint (a JSON
schema, any JSON object, a regex, a list of choices or an EBNF grammar); the engine compiles it once
per (kind, text) in its `GrammarCache` (one per engine, hence per tokenizer) and gives every
generated sequence its own matcher. Before a step samples, `fill_bitmasks` writes the packed int32
bitmask of the step's rows ([n, ceil(vocab / 32)], all bits set for unconstrained rows) on the
host, the matchers of the whole batch filled by xgrammar's thread pool in one call; the batch
sampler copies it to the device once and masks the logits there. The matcher learns each token
when it reaches the host (`accept`), so a step with constrained rows waits for the previous one.

bad_words (vLLM's semantics): every word is tokenized as it would appear at the start of the
output and after a space; a one-token word is always banned (the batch sampler bans it as a -inf
logit bias, with no host work), the last token of a longer word is banned when the tokens before
it are the last ones generated (`BadWords`, through the same bitmask).
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from llmc.errors import RequestError

_KINDS = ("json", "json_object", "regex", "choice", "grammar")
_MAX_CACHED_GRAMMARS = 256


@dataclass
class GuidedDecodingParams:
    """One output constraint (vLLM's GuidedDecodingParams / StructuredOutputsParams): set exactly one.

    Fields:
        json: a JSON schema (dict or JSON text); the output is a JSON value valid against it.
        json_object: True: the output is any JSON object.
        regex: the output matches this regular expression.
        choice: the output is exactly one of these strings.
        grammar: the output is a sentence of this EBNF grammar (GBNF syntax, `root` the start rule).
        strict: for `json`: properties the schema does not list are refused (OpenAI's `strict`).
    """

    json: str | dict | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    strict: bool = True

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise RequestError(f"SamplingParams.guided_decoding must set exactly one of {', '.join(_KINDS)}; "
                               f"got {', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise RequestError("SamplingParams.guided_decoding.json must be a JSON schema (a dict or JSON text)")
        if self.choice is not None and not (
                isinstance(self.choice, list) and self.choice and all(isinstance(c, str) and c for c in self.choice)):
            raise RequestError("SamplingParams.guided_decoding.choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple:
        """What identifies the compiled grammar (with the tokenizer of the engine that compiles it)."""
        value = getattr(self, self.kind)
        text = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else str(value)
        return self.kind, text, self.strict

    def grammar_object(self):
        """The xgrammar Grammar (tokenizer-free); RequestError naming the field if it is invalid."""
        import xgrammar as xgr

        kind = self.kind
        schema = None
        if kind == "json":
            schema = self.json if isinstance(self.json, str) else json.dumps(self.json)
            _refuse_unenforced(schema, self.strict)
        try:
            if kind == "json":
                return xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=self.strict)
            if kind == "json_object":
                return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if kind == "regex":
                return xgr.Grammar.from_regex(self.regex)
            if kind == "choice":
                return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice))
            return xgr.Grammar.from_ebnf(self.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            lines = str(e).strip().splitlines() or [type(e).__name__]
            reason = re.sub(r"^\[[\d:]+\] \S+: ", "", lines[0])  # xgrammar's "[time] file.cc:line: "
            raise RequestError(f"SamplingParams.guided_decoding.{kind} is not valid: {reason}") from None


StructuredOutputsParams = GuidedDecodingParams  # vLLM's newer name

# JSON-schema keywords xgrammar (0.2.8) compiles but does not enforce: a document that breaks them is
# generated as readily as one that keeps them (measured with xgrammar.testing's acceptance check). vLLM
# refuses schemas with the keywords its xgrammar backend cannot honour; so does llmc, naming the keyword.
_UNENFORCED = {"uniqueItems": "unique items", "contains": "an item that must be present",
               "minContains": "an item that must be present", "maxContains": "an item that must be present",
               "not": "a negated schema", "if": "a conditional schema", "then": "a conditional schema",
               "else": "a conditional schema"}
_SUBSCHEMA = ("items", "additionalProperties", "contains", "not", "if", "then", "else", "propertyNames",
              "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _refuse_unenforced(schema_text: str, strict: bool) -> None:
    """RequestError naming the first place of the schema that the grammar would not enforce: a keyword of
    `_UNENFORCED`, an allOf of several schemas, a $ref outside the document, or (strict) a required
    property the object does not declare (strict objects hold only the properties they list)."""
    try:
        schema = json.loads(schema_text)
    except ValueError:
        return  # not JSON: xgrammar's own message says so

    def walk(node: Any, path: str) -> str | None:
        if not isinstance(node, dict):
            return None
        for keyword, what in _UNENFORCED.items():
            if keyword in node:
                return f"{path}.{keyword} ({what})"
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
            return f"{path}.allOf of {len(node['allOf'])} schemas (only one)"
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            return f"{path}.$ref {ref!r} (only references inside the schema, '#/...')"
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        if strict and node.get("additionalProperties") in (None, False) and "patternProperties" not in node:
            undeclared = [name for name in node.get("required") or () if name not in properties]
            if undeclared:
                return f"{path}.required {undeclared[0]!r} (not in properties: a strict object holds only those)"
        children = [(f"{path}.{k}", node[k]) for k in _SUBSCHEMA if k in node]
        children += [(f"{path}.{k}[{i}]", child) for k in _SUBSCHEMA_LISTS if isinstance(node.get(k), list)
                     for i, child in enumerate(node[k])]
        children += [(f"{path}.{k}.{name}", child) for k in _SUBSCHEMA_MAPS if isinstance(node.get(k), dict)
                     for name, child in node[k].items()]
        return next((found for child_path, child in children if (found := walk(child, child_path))), None)

    found = walk(schema, "schema")
    if found is not None:
        raise RequestError(f"SamplingParams.guided_decoding.json: {found} is not supported: the grammar backend "
                           "(xgrammar) would not enforce it; remove it from the schema")


class GrammarCache:
    """Compiled grammars of one engine (one tokenizer and vocabulary), keyed by `GuidedDecodingParams.key()`."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, list(eos_token_ids)
        self._compiler = None
        self._compiled: OrderedDict[tuple, Any] = OrderedDict()
        self._batch_matcher = None
        self.num_compiled = 0
        self.control_token_ids: list[int] = []  # set with the compiler

    def batch_matcher(self):
        """xgrammar's threaded filler of a batch's bitmask rows."""
        if self._batch_matcher is None:
            import xgrammar as xgr

            self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=2)
        return self._batch_matcher

    def compile(self, params: GuidedDecodingParams):
        key = params.key()
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key]
        grammar = params.grammar_object()
        compiled = self._grammar_compiler().compile_grammar(grammar)
        self.num_compiled += 1
        self._compiled[key] = compiled
        if len(self._compiled) > _MAX_CACHED_GRAMMARS:
            self._compiled.popitem(last=False)
        return compiled

    def _grammar_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.eos_token_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            # JSON forbids raw control characters in strings, which xgrammar's JSON grammar lets
            # through; with compact JSON (no free whitespace) no token holding one is ever valid.
            self.control_token_ids = [t for t, piece in enumerate(info.decoded_vocab)
                                      if t not in self.eos_token_ids and any(b < 0x20 for b in piece)]
        return self._compiler

    def matcher(self, params: GuidedDecodingParams) -> GrammarConstraint:
        import xgrammar as xgr

        return GrammarConstraint(xgr.GrammarMatcher(self.compile(params)))


class GrammarConstraint:
    """One sequence's grammar matcher."""

    def __init__(self, matcher):
        self.matcher = matcher

    def accept(self, token_ids: list[int]) -> None:
        for token in token_ids:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                return  # past the grammar's end (ignore_eos, max_tokens): nothing more to constrain

    def is_active(self) -> bool:
        return not self.matcher.is_terminated()


class BadWords:
    """Multi-token bad words of one sequence: their prefixes, matched against its last tokens."""

    def __init__(self, words: list[list[int]], output_token_ids: list[int]):
        self.words = [w for w in words if len(w) > 1]
        self.history = list(output_token_ids)

    def accept(self, token_ids: list[int]) -> None:
        self.history.extend(token_ids)

    def banned(self, extra: list[int] = ()) -> list[int]:
        history = self.history + list(extra)
        return [w[-1] for w in self.words if len(history) >= len(w) - 1 and history[len(history) - len(w) + 1:] == w[:-1]]


def bad_words_token_ids(words: list[str], tokenizer) -> list[list[int]]:
    """vLLM's tokenization of bad words: as written (leading spaces stripped) and after a space, the
    second kept only where the space gives other tokens of the same count."""
    result = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        result.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            result.append(spaced)
    return [ids for ids in result if ids]


@dataclass
class Constraints:
    """A sequence's host-side constraints (either may be None)."""

    grammar: GrammarConstraint | None
    bad_words: BadWords | None

    def accept(self, token_ids: list[int]) -> None:
        for part in (self.grammar, self.bad_words):
            if part is not None:
                part.accept(token_ids)


def sequence_constraints(params, grammars: GrammarCache) -> tuple[list[int], Constraints | None]:
    """A new sequence's one-token bad words (banned by the sampler) and its host constraints."""
    words = bad_words_token_ids(params.bad_words, grammars.tokenizer) if params.bad_words else []
    banned = {w[0] for w in words if len(w) == 1}
    grammar = None
    if params.guided_decoding is not None:
        grammar = grammars.matcher(params.guided_decoding)
        if params.guided_decoding.kind in ("json", "json_object"):
            banned.update(grammars.control_token_ids)
    banned = sorted(banned)
    bad_words = BadWords(words, []) if any(len(w) > 1 for w in words) else None
    if grammar is None and bad_words is None:
        return banned, None
    return banned, Constraints(grammar, bad_words)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_bitmasks(constraints: list[Constraints | None], vocab_size: int,
                  batch_matcher) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The packed bitmasks [n, ceil(vocab / 32)] int32 (bit t of a row set: token t allowed) of a
    step's rows: the grammars' (xgrammar fills the grammar rows of the whole batch in one threaded
    call) and the bad words'; None where no row has one. Two, because vLLM v1 reports logprobs of
    the logits with the grammar's mask and without the bad words' (BatchSampler.sample)."""
    grammar_rows = [i for i, c in enumerate(constraints) if c is not None and c.grammar is not None
                    and c.grammar.is_active()]
    bad_rows = [i for i, c in enumerate(constraints) if c is not None and c.bad_words is not None]
    grammar = bad_words = None
    if grammar_rows:
        grammar = torch.full((len(constraints), bitmask_words(vocab_size)), -1, dtype=torch.int32)
        batch_matcher.batch_fill_next_token_bitmask([constraints[i].grammar.matcher for i in grammar_rows],
                                                    grammar, grammar_rows)
    if bad_rows:
        bad_words = torch.full((len(constraints), bitmask_words(vocab_size)), -1, dtype=torch.int32)
        for i in bad_rows:
            clear_bits(bad_words[i], constraints[i].bad_words.banned())
    return grammar, bad_words


def clear_bits(row: torch.Tensor, token_ids: list[int]) -> None:
    """Ban `token_ids` in one packed bitmask row (int32 [words]) on the host."""
    if not token_ids:
        return
    values = row.numpy().view(np.uint32)
    for token in token_ids:
        values[token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)


def unpack_bitmask(bitmask: Tensor, vocab_size: int) -> Tensor:
    """[n, words] int32 -> [n, vocab] bool (True: allowed), as one device op."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], bitmask.shape[1] * 32)[:, :vocab_size].bool()  # 0 rows too


@torch.inference_mode()
def mask_verify_rows(logits: Tensor, states, drafts: list[list[int]], raw: Tensor | None = None) -> None:
    """n-gram speculation: each sequence's k + 1 verify rows (consecutive in `logits`) get its
    banned tokens and its constraints (`mask_draft_rows`). `raw`, a copy of `logits` the logprobs
    are taken from, gets the grammars' masks only (vLLM v1 applies bad words after the logprobs)."""
    start = 0
    for state, state_drafts in zip(states, drafts):
        end = start + len(state_drafts) + 1
        rows = logits[start:end]
        if state.banned_token_ids:
            rows[:, state.banned_token_ids] = float("-inf")
        if state.constraints is not None:
            mask_draft_rows(rows, state.constraints, state_drafts, logits.shape[1],
                            None if raw is None else raw[start:end])
        start = end


def mask_draft_rows(logits: Tensor, constraints: Constraints, drafts: list[int], vocab_size: int,
                    raw: Tensor | None = None) -> None:
    """n-gram speculation: mask a sequence's k + 1 verify rows, row i as the grammar stands after
    drafts[:i] (the matcher walks the drafts and is rolled back); rows after a draft the grammar
    refuses are left as they are (that draft is rejected, so they are never sampled). `raw` (the
    same rows' copy for logprobs) gets the grammar's mask and not the bad words'."""
    rows = len(drafts) + 1
    grammar_bits = torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)
    bad_bits = grammar_bits.clone()
    grammar = constraints.grammar
    num_accepted = 0
    for i in range(rows):
        if grammar is not None and grammar.is_active():
            grammar.matcher.fill_next_token_bitmask(grammar_bits, i)
        if constraints.bad_words is not None:
            clear_bits(bad_bits[i], constraints.bad_words.banned(drafts[:i]))
        if i == len(drafts) or (grammar is not None and not _try_accept(grammar, drafts[i])):
            break
        num_accepted += grammar is not None
    if grammar is not None and num_accepted:
        grammar.matcher.rollback(num_accepted)
    allowed = unpack_bitmask(grammar_bits.to(logits.device), vocab_size)
    for target in (logits,) if raw is None else (logits, raw):
        target.masked_fill_(~allowed, float("-inf"))
    logits.masked_fill_(~unpack_bitmask(bad_bits.to(logits.device), vocab_size), float("-inf"))


def _try_accept(grammar: GrammarConstraint, token: int) -> bool:
    return grammar.is_active() and grammar.matcher.accept_token(token)

