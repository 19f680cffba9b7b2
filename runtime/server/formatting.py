"""Response pieces in OpenAI's wire format: logprobs (completions' and chat's shapes), usage, SSE."""

from __future__ import annotations

import json
from collections.abc import Iterable

from llmc.runtime.outputs import RequestOutput
from llmc.runtime.server.errors import json_logprob

SSE_DONE = "data: [DONE]\n\n"

TokenLogprobs = tuple[int, dict[int, float] | None]  # (token id, {token id: logprob}) or None (first prompt token)


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def decode_token(tokenizer, token_id: int) -> str:
    """One token's text, special tokens spelled out (as logprob entries show them)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer, entries: Iterable[TokenLogprobs], text_offset: int = 0,
                        token_texts: list[str] | None = None, num_top: int | None = None) -> tuple[dict, int]:
    """The completions API's `logprobs` object for `entries`, and the text offset after them.

    `tokens[i]` is token i's text, `token_logprobs[i]` its logprob (None for the first prompt
    token, which has no context), `top_logprobs[i]` {token text: logprob} of the most likely
    tokens plus the token itself (the `num_top` best, when given: an echoed prompt's entries may
    hold more, for prompt_logprobs), `text_offset[i]` where its text starts in the returned text.
    Two tokens of one text (byte pieces that each decode to U+FFFD) keep the higher logprob, as
    vLLM's do: lm-eval's is_greedy compares the token's logprob with the best of top_logprobs.
    `token_texts` overrides the text of the first entries (an echoed text prompt: the pieces of
    the text as sent, see `text_pieces`).
    """
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for index, (token_id, logprobs) in enumerate(entries):
        token = token_texts[index] if token_texts is not None and index < len(token_texts) else \
            decode_token(tokenizer, token_id)
        tokens.append(token)
        offsets.append(text_offset)
        text_offset += len(token)
        if logprobs is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(json_logprob(logprobs[token_id]) if token_id in logprobs else None)
        top: dict[str, float] = {}
        for t in top_tokens(logprobs, token_id, num_top):
            top.setdefault(decode_token(tokenizer, t), json_logprob(logprobs[t]))  # best first: the higher stays
        top_logprobs.append(top)
    body = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}
    return body, text_offset


def top_tokens(logprobs: dict, token_id: int, num_top: int | None) -> list[int]:
    """The ids of `logprobs`, best first: all of them, or the `num_top` best and `token_id`."""
    ranked = sorted(logprobs, key=logprobs.get, reverse=True)
    return ranked if num_top is None else [t for i, t in enumerate(ranked) if i < num_top or t == token_id]


def text_pieces(tokenizer, text: str, token_ids: list[int], add_special_tokens: bool) -> list[str] | None:
    """The piece of `text` each of its tokens covers, so that "".join(pieces) == text: a token the
    tokenizer added (bos) covers "", and of the byte tokens of one character the last covers it.
    None when the tokenizer gives no character offsets or `token_ids` are not this text's tokens."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    encoded = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    if list(encoded["input_ids"]) != list(token_ids):
        return None
    starts, position = [], 0
    for start, end in encoded["offset_mapping"]:
        if end > start:  # a token of the text (an added special token spans nothing)
            position = max(position, start)
        starts.append(position)
    starts[:1] = [0]
    bounds = starts[1:] + [len(text)]
    return [text[a:b] for a, b in zip(starts, bounds)]


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list[dict[int, float]], num_top: int) -> dict:
    """The chat API's `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for token_id, candidates in zip(token_ids, logprobs):
        ranked = sorted(candidates.items(), key=lambda item: item[1], reverse=True)[:num_top]
        entry = _chat_token(tokenizer, token_id, candidates.get(token_id, float("-inf")))
        entry["top_logprobs"] = [_chat_token(tokenizer, t, lp) for t, lp in ranked]
        content.append(entry)
    return {"content": content}


def _chat_token(tokenizer, token_id: int, logprob: float) -> dict:
    token = decode_token(tokenizer, token_id)
    return {"token": token, "logprob": json_logprob(logprob), "bytes": list(token.encode("utf-8"))}


def usage(outputs: Iterable[RequestOutput], count_completion_tokens: bool = True) -> dict:
    """Prompt tokens once per prompt, completion tokens summed over every returned sequence, and
    `prompt_tokens_details.cached_tokens`: the prompt tokens served from the prefix cache."""
    outputs = list(outputs)
    num_prompt = sum(o.num_prompt_tokens for o in outputs)
    num_completion = sum(len(c.token_ids) for o in outputs for c in o.outputs) if count_completion_tokens else 0
    return usage_body(num_prompt, num_completion, sum(o.num_cached_tokens for o in outputs))


def usage_body(num_prompt: int, num_completion: int, num_cached: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion, "prompt_tokens_details": {"cached_tokens": num_cached}}


def prompt_logprobs(tokenizer, output: RequestOutput, num_top: int) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob, rank,
    decoded_token}} holding the `num_top` most likely tokens and the prompt token (the engine may
    hold more: echo + logprobs asks it for the larger k). `rank` is the place in the whole
    vocabulary (1 = most likely), the prompt token's too: the engine's Logprob.rank."""
    if output.prompt_logprobs is None:
        return None
    entries: list[dict | None] = []
    for token_id, candidates in zip(output.prompt_token_ids, output.prompt_logprobs):
        if candidates is None:
            entries.append(None)
            continue
        ranked = top_tokens(candidates, token_id, num_top)
        entries.append({str(t): {"logprob": json_logprob(candidates[t]), "rank": _rank(candidates[t], i, num_top),
                                 "decoded_token": decode_token(tokenizer, t)} for i, t in enumerate(ranked)})
    return entries


def _rank(logprob: float, index: int, num_top: int) -> int | None:
    """A Logprob's rank; for a plain float, its place among the top `num_top` (None past them: unknown)."""
    rank = getattr(logprob, "rank", None)
    if rank is not None:
        return rank
    return index + 1 if index < num_top else None


class DeltaTracker:
    """What a stream has already sent of each sequence, keyed by (prompt index, sequence index):
    the next chunk carries only what is new, and a sequence's finish goes out once (the engine's
    cumulative outputs repeat a finished sequence while its siblings of n > 1 run on)."""

    def __init__(self):
        self._sent: dict[tuple[int, int], tuple[int, int]] = {}  # key -> (num tokens, num chars)
        self._finished: set[tuple[int, int]] = set()

    def is_first(self, key: tuple[int, int]) -> bool:
        return key not in self._sent

    def was_finished(self, key: tuple[int, int]) -> bool:
        """Its finish was sent: nothing more goes out for it."""
        return key in self._finished

    def finish(self, key: tuple[int, int], is_finished: bool) -> bool:
        """Whether this chunk carries the sequence's finish (the first output that says it is)."""
        if not is_finished or key in self._finished:
            return False
        self._finished.add(key)
        return True

    def delta(self, key: tuple[int, int], text: str, token_ids: list[int]) -> tuple[str, slice]:
        """The text not sent yet, and the slice of token positions not sent yet; marks them sent."""
        num_tokens, num_chars = self._sent.get(key, (0, 0))
        self._sent[key] = (len(token_ids), max(num_chars, len(text)))
        return text[num_chars:], slice(num_tokens, len(token_ids))
