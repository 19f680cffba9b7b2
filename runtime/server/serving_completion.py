"""POST /v1/completions: text or token-id prompts (one or many), echo, logprobs, n, streaming.

With echo and logprobs the prompt's own logprobs come first (the first is None): this is what
lm-eval's loglikelihood requests (echo=true, max_tokens=0 or 1, logprobs=k) read.
"""

from __future__ import annotations

import asyncio

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from torch import Tensor

from llmc.errors import RequestError
from llmc.runtime.outputs import CompletionOutput, RequestOutput
from llmc.runtime.prompt_embeds import NOT_ENABLED
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.server.errors import ApiError, invalid
from llmc.runtime.server.formatting import (SSE_DONE, DeltaTracker, completion_logprobs, prompt_logprobs, sse,
                                            text_pieces, usage, usage_body)
from llmc.runtime.server.protocol import MAX_PROMPTS, CompletionRequest
from llmc.runtime.server.serving import EventStream, Generation, ServingContext, new_id, parse_generation_request, respond


@dataclass
class _Prompt:
    text: str | None  # as sent, when sent as text (echo returns it verbatim)
    token_ids: list[int] | Tensor  # a prompt sent as embeddings (prompt_embeds): its [num_tokens, hidden_size] rows

    def __post_init__(self):
        self.sent_as_text = self.text is not None


async def create_completion(ctx: ServingContext, body: object, arrival_time: float | None = None
                            ) -> dict | EventStream:
    """The response body, or (stream=true) an iterator of SSE events."""
    request, params = parse_generation_request(ctx, CompletionRequest, body)
    prompts = [await _truncated(ctx, request, p, params.truncate_prompt_tokens) for p in await _prompts(ctx, request)]
    for prompt in prompts:
        ctx.check_prompt_length(prompt.token_ids, params, "prompt", request.max_tokens)
    request_id = new_id("cmpl")
    generation = await ctx.generate([p.token_ids for p in prompts], params, request_id, request.priority, arrival_time,
                                     ctx.lora_request(request.model), cache_salt=request.cache_salt)
    return await respond(generation, _Reply(ctx, request, params, prompts, request_id), request.stream)


async def _prompts(ctx: ServingContext, request: CompletionRequest) -> list[_Prompt]:
    """The request's prompts: those sent as embeddings first (vLLM's order), then text and token-id ones."""
    embedded = await _embeds_prompts(ctx, request.prompt_embeds)
    prompt = request.prompt
    if prompt is None or prompt == "" or prompt == []:
        return embedded
    prompts = embedded + await _text_prompts(ctx, request, prompt)
    if len(prompts) > MAX_PROMPTS:
        raise invalid("prompt", f"at most {MAX_PROMPTS} prompts per request (prompt and prompt_embeds together), got "
                      f"{len(prompts)}; split the request")
    return prompts


async def _embeds_prompts(ctx: ServingContext, prompt_embeds: str | list[str] | None) -> list[_Prompt]:
    """Prompts sent as embeddings (runtime/prompt_embeds.py), refused unless the engine takes them; decoded off the
    event loop."""
    if not prompt_embeds:
        return []
    if not ctx.engine_loop.engine.options.enable_prompt_embeds:
        raise ApiError(400, NOT_ENABLED, param="prompt_embeds")
    items = [prompt_embeds] if isinstance(prompt_embeds, str) else prompt_embeds
    if len(items) > MAX_PROMPTS:
        raise invalid("prompt_embeds", f"at most {MAX_PROMPTS} prompts per request, got {len(items)}; split the request")
    where = "prompt_embeds" if isinstance(prompt_embeds, str) else "prompt_embeds.{}"
    try:
        rows = await asyncio.gather(*(ctx.decode_prompt_embeds_off_loop(item, where.format(i))
                                      for i, item in enumerate(items)))
    except RequestError as e:
        raise ApiError(400, str(e), param="prompt_embeds") from None
    return [_Prompt(None, r) for r in rows]


async def _text_prompts(ctx: ServingContext, request: CompletionRequest, prompt) -> list[_Prompt]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise invalid("prompt", "must not be empty")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    if len(prompt) > MAX_PROMPTS:
        raise invalid("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}; split the request")
    texts = [item for item in prompt if isinstance(item, str)]
    encoded = iter(await asyncio.gather(*(ctx.encode_off_loop(t, request.add_special_tokens, "prompt") for t in texts)))
    prompts = []
    for item in prompt:
        if isinstance(item, str):
            prompts.append(_Prompt(item, _nonempty(next(encoded), request.add_special_tokens)))
            continue
        if not item:
            raise invalid("prompt", "a token-id prompt must not be empty")
        ctx.check_token_ids(item, "prompt")
        prompts.append(_Prompt(None, list(item)))
    return prompts


def _nonempty(token_ids: list[int], add_special_tokens: bool) -> list[int]:
    if not token_ids:  # "" without the tokenizer's bos
        hint = "" if add_special_tokens else " (or set add_special_tokens to true)"
        raise invalid("prompt", f"a text prompt must give at least one token; this one gives none: send some text{hint}")
    return token_ids


async def _truncated(ctx: ServingContext, request: CompletionRequest, prompt: _Prompt, keep: int | None) -> _Prompt:
    """At most `keep` tokens of the prompt (truncate_prompt_tokens), cut here rather than in the engine so
    that echo, its logprob tokens and usage all show the prompt the model saw (a cut text prompt echoes
    its tokens decoded, as vLLM's does): a token-id prompt's last `keep`, a text's tokenized again with
    the tokenizer's truncation, which keeps its BOS (runtime/tokenizer.encode_text)."""
    if keep is None or len(prompt.token_ids) <= keep:
        return prompt
    if prompt.text is None:  # token ids, or embeddings' rows
        return _Prompt(None, prompt.token_ids[-keep:])
    return _Prompt(None, await ctx.encode_off_loop(prompt.text, request.add_special_tokens, "prompt", keep))


class _Reply:
    """Builds choices from engine outputs; choice index = prompt index * n + sequence index."""

    def __init__(self, ctx: ServingContext, request: CompletionRequest, params: SamplingParams,
                 prompts: list[_Prompt], request_id: str):
        self.ctx = ctx
        self.request = request
        self.params = params
        self.prompts = prompts
        self.request_id = request_id
        self.created = int(time.time())

    def _header(self) -> dict:
        return {"id": self.request_id, "object": "text_completion", "created": self.created,
                "model": self.ctx.response_model(self.request.model)}

    def _prompt_text(self, index: int) -> str:
        prompt = self.prompts[index]
        if prompt.text is None:
            prompt.text = self.ctx.tokenizer.decode(prompt.token_ids, skip_special_tokens=False)
        return prompt.text

    def _generated(self, completion: CompletionOutput) -> tuple[str, list[int], list]:
        """(text, token ids, logprobs) of a sequence as returned: nothing for echo with max_tokens=0."""
        if self.request.wants_prompt_only:
            return "", [], []
        return completion.text, completion.token_ids, completion.logprobs or []

    def _prompt_entries(self, output: RequestOutput) -> list:
        if not self.request.echo or self.request.logprobs is None:
            return []
        return list(zip(output.prompt_token_ids, output.prompt_logprobs or [None] * len(output.prompt_token_ids)))

    def _prompt_pieces(self, index: int) -> list[str] | None:
        """The echoed text prompt's pieces per token, so that logprob tokens and text_offset match the
        text returned (its bos, which the text does not show, covers ""); None for a token-id prompt,
        whose echo is its decoded text, special tokens spelled out, like its logprob tokens."""
        prompt = self.prompts[index]
        if not (self.request.echo and self.request.logprobs is not None and prompt.sent_as_text):
            return None
        return text_pieces(self.ctx.tokenizer, prompt.text, prompt.token_ids, self.request.add_special_tokens)

    def _choice(self, index: int, completion: CompletionOutput, text: str, logprobs: dict | None) -> dict:
        return {"index": index * self.request.n + completion.index, "text": text, "logprobs": logprobs,
                "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason}

    def _prompt_logprobs(self, output: RequestOutput) -> list | None:
        if self.request.prompt_logprobs is None:
            return None
        return prompt_logprobs(self.ctx.tokenizer, output, self.request.prompt_logprobs)

    def response(self, outputs: list[RequestOutput]) -> dict:
        choices = []
        for index, output in enumerate(outputs):
            for completion in output.outputs:
                text, token_ids, logprobs = self._generated(completion)
                if self.request.echo:
                    text = self._prompt_text(index) + text
                body = None
                if self.request.logprobs is not None:
                    entries = self._prompt_entries(output) + list(zip(token_ids, logprobs))
                    body, _ = completion_logprobs(self.ctx.tokenizer, entries, token_texts=self._prompt_pieces(index),
                                                  num_top=self.request.logprobs)
                choice = self._choice(index, completion, text, body)
                if self.request.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._prompt_logprobs(output)
                if self.request.return_token_ids:  # vLLM's: on each choice
                    choice |= {"prompt_token_ids": output.prompt_token_ids, "token_ids": list(token_ids)}
                choices.append(choice)
        return {**self._header(), "choices": choices,
                "usage": usage(outputs, count_completion_tokens=not self.request.wants_prompt_only)}

    async def stream(self, generation: Generation) -> AsyncIterator[str]:
        """SSE chunks as tokens come; a final usage chunk with stream_options.include_usage; [DONE]."""
        tracker = DeltaTracker()
        offsets: dict[tuple[int, int], int] = {}
        finals: dict[int, RequestOutput] = {}
        try:
            async for index, output in generation:
                finals[index] = output
                for completion in output.outputs:
                    chunk = self._chunk(index, output, completion, tracker, offsets)
                    if chunk is not None:
                        yield sse(chunk)
            if self.request.include_usage:
                final_outputs = [finals[i] for i in sorted(finals)]
                yield sse({**self._header(), "choices": [],
                           "usage": usage(final_outputs, count_completion_tokens=not self.request.wants_prompt_only)})
        except ApiError as e:
            yield sse(e.body())
        finally:
            generation.abort()
        yield SSE_DONE

    def _chunk(self, index: int, output: RequestOutput, completion: CompletionOutput, tracker: DeltaTracker,
               offsets: dict) -> dict | None:
        key = (index, completion.index)
        if tracker.was_finished(key):
            return None
        is_first = tracker.is_first(key)
        text, token_ids, logprobs = self._generated(completion)
        delta_text, new = tracker.delta(key, text, token_ids)
        entries = list(zip(token_ids[new], logprobs[new]))
        if is_first and self.request.echo:
            delta_text = self._prompt_text(index) + delta_text
            entries = self._prompt_entries(output) + entries
        if not tracker.finish(key, completion.is_finished) and not delta_text and not entries:
            return None  # tokens held back (an unfinished character or a possible stop string)
        body = None
        if self.request.logprobs is not None:
            pieces = self._prompt_pieces(index) if is_first else None
            body, offsets[key] = completion_logprobs(self.ctx.tokenizer, entries, offsets.get(key, 0), pieces,
                                                     num_top=self.request.logprobs)
        choice = self._choice(index, completion, delta_text, body)
        if self.request.return_token_ids:  # vLLM's: this chunk's new tokens; the prompt's in a sequence's first chunk
            choice |= {"prompt_token_ids": output.prompt_token_ids if is_first else None,
                       "token_ids": list(token_ids[new])}
        chunk = {**self._header(), "choices": [choice]}
        if self.request.continuous_usage:  # vLLM: this prompt's tokens and this sequence's so far
            chunk["usage"] = usage_body(output.num_prompt_tokens, len(token_ids), output.num_cached_tokens)
        elif self.request.include_usage:
            chunk["usage"] = None  # as OpenAI: only the final chunk carries usage
        return chunk
