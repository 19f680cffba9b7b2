"""POST /v1/embeddings: OpenAI's embeddings API (and vLLM's chat form, `messages`), on an engine started with
runner pooling (runtime/pooling.py). Each input is one engine request; the reply lists the embeddings in input
order, as float arrays or (encoding_format base64, what the openai SDK asks by default) the base64 of their
little-endian float32 bytes."""

from __future__ import annotations

import asyncio
import base64
import time

import numpy as np

from llmc.errors import RequestError
from llmc.runtime.pooling import PoolingParams
from llmc.runtime.server.errors import ApiError, as_api_error, invalid
from llmc.runtime.server.protocol import MAX_PROMPTS, EmbeddingRequest
from llmc.runtime.server.serving import CONTEXT_LENGTH_PREFIX, ServingContext, new_id, parse_body


async def create_embedding(ctx: ServingContext, body: object, arrival_time: float | None = None) -> dict:
    """The response body."""
    request = parse_body(EmbeddingRequest, body)
    request.check()
    ctx.check_model(request.model)
    ctx.require_ready()
    engine = ctx.engine_loop.engine
    if engine.pooler is None:
        raise ApiError(400, "The model does not support Embeddings API: this server generates text; start it with "
                       "--runner pooling to serve embeddings", param="model")
    keep = ctx.max_model_len if request.truncate_prompt_tokens == -1 else request.truncate_prompt_tokens
    try:
        params = PoolingParams(dimensions=request.dimensions, normalize=request.normalize, truncate_prompt_tokens=keep)
        engine.pooler.check(params)
    except RequestError as e:
        raise as_api_error(e) from None
    prompts = [_checked_length(ctx, p if keep is None else p[-keep:]) for p in await _prompts(ctx, request, keep)]
    request_id = new_id("embd")
    generation = await ctx.generate(prompts, params, request_id, request.priority, arrival_time,
                                    ctx.lora_request(request.model))
    try:
        outputs = await generation.final_outputs()
    finally:
        generation.abort()
    num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"id": request_id, "object": "list", "created": int(time.time()),
            "model": ctx.response_model(request.model),
            "data": [{"index": i, "object": "embedding", "embedding": _encoded(o.outputs.embedding, request.encoding_format)}
                     for i, o in enumerate(outputs)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0,
                      "prompt_tokens_details": None}}


async def _prompts(ctx: ServingContext, request: EmbeddingRequest, keep: int | None) -> list[list[int]]:
    if request.messages is not None:
        return [await ctx.render_chat_off_loop([m.as_template_input(i) for i, m in enumerate(request.messages)],
                                               request.template_options())]
    items = request.input
    if isinstance(items, str) or (items and isinstance(items[0], int)):
        items = [items]
    if not items:
        raise invalid("input", "must not be empty")
    if len(items) > MAX_PROMPTS:
        raise invalid("input", f"at most {MAX_PROMPTS} inputs per request, got {len(items)}; split the request")
    add_special = request.add_special_tokens is not False
    texts = [item for item in items if isinstance(item, str)]
    encoded = iter(await asyncio.gather(*(ctx.encode_off_loop(t, add_special, "input", keep) for t in texts)))
    prompts = []
    for item in items:
        token_ids = next(encoded) if isinstance(item, str) else list(item)
        if not token_ids:
            raise invalid("input", "an input must give at least one token; this one gives none")
        ctx.check_token_ids(token_ids, "input")
        prompts.append(token_ids)
    return prompts


def _checked_length(ctx: ServingContext, token_ids: list[int]) -> list[int]:
    """400 context_length_exceeded (vLLM's words) for an input longer than max_model_len."""
    if len(token_ids) > ctx.max_model_len:
        raise ApiError(400, f"{CONTEXT_LENGTH_PREFIX} {ctx.max_model_len} tokens. However, you requested "
                       f"{len(token_ids)} tokens in the input for embedding generation. Please reduce the length of "
                       "the input (or set truncate_prompt_tokens).", param="input", code="context_length_exceeded")
    return token_ids


def _encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return embedding
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
