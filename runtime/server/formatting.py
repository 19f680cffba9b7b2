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


def completion_logprobs(tokenizer, entries: Iterable[TokenLogprobs], text_offset: int = 0) -> tuple[dict, int]:
    """The completions API's `logprobs` object for `entries`, and the text offset after them.

    `tokens[i]` is token i's text, `token_logprobs[i]` its logprob (None for the first prompt
    token, which has no context), `top_logprobs[i]` {token text: logprob} of the most likely
    tokens plus the token itself, `text_offset[i]` where its text starts in the returned text.
    """
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, logprobs in entries:
        token = decode_token(tokenizer, token_id)
        tokens.append(token)
        offsets.append(text_offset)
        text_offset += len(token)
        if logprobs is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(json_logprob(logprobs[token_id]) if token_id in logprobs else None)
        ranked = sorted(logprobs.items(), key=lambda item: item[1], reverse=True)
        top_logprobs.append({decode_token(tokenizer, t): json_logprob(lp) for t, lp in ranked})
    body = {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}
    return body, text_offset


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
    """Prompt tokens once per prompt, completion tokens summed over every returned sequence."""
    outputs = list(outputs)
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    num_completion = sum(len(c.token_ids) for o in outputs for c in o.outputs) if count_completion_tokens else 0
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion, "total_tokens": num_prompt + num_completion}


class DeltaTracker:
    """What a stream has already sent of each sequence, keyed by (prompt index, sequence index):
    the next chunk carries only what is new."""

    def __init__(self):
        self._sent: dict[tuple[int, int], tuple[int, int]] = {}  # key -> (num tokens, num chars)

    def is_first(self, key: tuple[int, int]) -> bool:
        return key not in self._sent

    def delta(self, key: tuple[int, int], text: str, token_ids: list[int]) -> tuple[str, slice]:
        """The text not sent yet, and the slice of token positions not sent yet; marks them sent."""
        num_tokens, num_chars = self._sent.get(key, (0, 0))
        self._sent[key] = (len(token_ids), max(num_chars, len(text)))
        return text[num_chars:], slice(num_tokens, len(token_ids))
