"""POST /v1/embeddings: OpenAI's embeddings API (and vLLM's chat form, `messages`), on an engine started with
runner pooling (runtime/pooling.py). Each input is one engine request; the reply lists the embeddings in input
order, as float arrays or (encoding_format base64, what the openai SDK asks by default) the base64 of their
little-endian float32 bytes.

On a sequence classifier, vLLM's POST /classify (/v1/classify): each input's class probabilities and top label.

Also vLLM's score and rerank APIs: POST /score (/v1/score) gives, on an embedding model, the cosine similarity
of text_1's and text_2's embeddings, on a cross-encoder (a classifier of one label) its score of the two texts
encoded as one pair; POST /rerank (/v1/rerank, /v2/rerank) the documents ordered by that score against the
query (Jina's and Cohere's reply form)."""

from __future__ import annotations

import asyncio
import base64
import time

import numpy as np
import torch

from llmc.errors import RequestError
from llmc.runtime.pooling import (CROSS_ENCODER_TRUNCATION, PoolingParams, check_cross_encoder, cosine_similarity,
                                  score_pairs, top_label)
from llmc.runtime.server.errors import ApiError, as_api_error, invalid
from llmc.runtime.server.protocol import (MAX_PROMPTS, ClassificationRequest, EmbeddingRequest, PoolingRequest, RerankRequest,
                                          ScoreRequest, _PoolingInput)
from llmc.runtime.server.serving import CONTEXT_LENGTH_PREFIX, ServingContext, new_id, parse_body


async def create_embedding(ctx: ServingContext, body: object, arrival_time: float | None = None,
                           pooling: bool = False) -> dict:
    """The response body. `pooling`: vLLM's POST /pooling, the same request and vectors, its reply's names ("pool-"
    ids, data items {"object": "pooling", "data"}); its `task` may ask a token task (each input's output at every
    prompt token as `data`: [num_tokens][width] floats, base64 the row-major float32 bytes), and on a classifier
    the data are its class probabilities."""
    request = parse_body(PoolingRequest if pooling else EmbeddingRequest, body)
    request.check()
    task = request.task if pooling else None  # None: the engine's
    if pooling and (task or _task(ctx)) == "classify":
        return await _classification(ctx, request, arrival_time, pooling=True)
    keep = _start(ctx, request.model, request.truncate_prompt_tokens, "Pooling" if pooling else "Embeddings",
                  (task or "embed").removeprefix("token_"), "task" if task else "model")
    params = _params(ctx, task=task, dimensions=request.dimensions, normalize=request.normalize,
                     use_activation=request.use_activation, truncate_prompt_tokens=keep)
    request_id = new_id("pool" if pooling else "embd")
    outputs = await _pooled(ctx, await _prompts(ctx, request, keep), params, request_id, request, arrival_time)
    num_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    kind, key = ("pooling", "data") if pooling else ("embedding", "embedding")
    return {"id": request_id, "object": "list", "created": int(time.time()),
            "model": ctx.response_model(request.model),
            "data": [{"index": i, "object": kind, key: _encoded(o.outputs.data, request.encoding_format)}
                     for i, o in enumerate(outputs)],
            "usage": _usage(num_tokens)}


async def create_classification(ctx: ServingContext, body: object, arrival_time: float | None = None) -> dict:
    """/classify: each input's class probabilities and most likely label (vLLM's reply)."""
    request = parse_body(ClassificationRequest, body)
    request.check()
    return await _classification(ctx, request, arrival_time)


async def _classification(ctx: ServingContext, request: ClassificationRequest | PoolingRequest,
                          arrival_time: float | None, pooling: bool = False) -> dict:
    """A classifier's reply to a checked request: /classify's, or (`pooling`) /pooling's (the probabilities as each
    item's data, float or base64)."""
    if pooling and (request.dimensions is not None or request.normalize is not None):
        raise invalid("dimensions" if request.dimensions is not None else "normalize",
                      "applies to embeddings; a classifier's request takes use_activation")
    keep = _start(ctx, request.model, request.truncate_prompt_tokens, "Pooling" if pooling else "Classification",
                  "classify", "task" if pooling else "model")
    params = _params(ctx, use_activation=request.use_activation, truncate_prompt_tokens=keep)
    request_id = new_id("pool" if pooling else "classify")
    outputs = await _pooled(ctx, await _prompts(ctx, request, keep), params, request_id, request, arrival_time)
    labels = ctx.engine_loop.engine.manifest.model.labels
    if pooling:
        data = [{"index": i, "object": "pooling", "data": _encoded(o.outputs.probs, request.encoding_format)}
                for i, o in enumerate(outputs)]
    else:
        data = [{"index": i, "label": top_label(labels, o.outputs.probs), "probs": o.outputs.probs,
                 "num_classes": len(o.outputs.probs)} for i, o in enumerate(outputs)]
    return {"id": request_id, "object": "list", "created": int(time.time()), "model": ctx.response_model(request.model),
            "data": data, "usage": _usage(sum(len(o.prompt_token_ids) for o in outputs))}


async def create_score(ctx: ServingContext, body: object, arrival_time: float | None = None) -> dict:
    """/score: one data item per (text_1, text_2) pair, vLLM's pairing (runtime/pooling.score_pairs)."""
    request = parse_body(ScoreRequest, body)
    keep = _start(ctx, request.model, request.truncate_prompt_tokens, "Score")
    texts_1 = [request.text_1] if isinstance(request.text_1, str) else request.text_1
    texts_2 = [request.text_2] if isinstance(request.text_2, str) else request.text_2
    try:
        pairs = score_pairs(len(texts_1), len(texts_2))
    except RequestError as e:
        raise as_api_error(e) from None
    request_id = new_id("score")
    scores, num_tokens = await _scores(ctx, texts_1, texts_2, pairs, "text_1", keep, request_id, request, arrival_time)
    return {"id": request_id, "object": "list", "created": int(time.time()), "model": ctx.response_model(request.model),
            "data": [{"index": k, "object": "score", "score": score} for k, score in enumerate(scores)],
            "usage": _usage(num_tokens)}


async def create_rerank(ctx: ServingContext, body: object, arrival_time: float | None = None) -> dict:
    """/rerank: the documents by relevance to the query, most relevant first, top_n of them (0 or none: all)."""
    request = parse_body(RerankRequest, body)
    keep = _start(ctx, request.model, request.truncate_prompt_tokens, "Rerank")
    if not request.documents:
        raise invalid("documents", "give at least one document")
    request_id = new_id("rerank")
    pairs = [(0, j) for j in range(len(request.documents))]
    scores, num_tokens = await _scores(ctx, [request.query], request.documents, pairs, "documents", keep, request_id,
                                       request, arrival_time)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    top_n = request.top_n or len(order)
    return {"id": request_id, "model": ctx.response_model(request.model),
            "usage": {"total_tokens": num_tokens},
            "results": [{"index": i, "document": {"text": request.documents[i]}, "relevance_score": scores[i]}
                        for i in order[:top_n]]}


async def _scores(ctx: ServingContext, texts_1: list[str], texts_2: list[str], pairs: list[tuple[int, int]],
                  param: str, keep: int | None, request_id: str, request, arrival_time: float | None
                  ) -> tuple[list[float], int]:
    """(each pair's score, the prompt tokens computed): on an embedding model the cosine of the two texts'
    embeddings (each text embedded once), on a cross-encoder its score of the two texts encoded as one pair."""
    if _task(ctx) == "classify":
        try:
            check_cross_encoder(ctx.engine_loop.engine.manifest.model)
        except RequestError as e:
            raise ApiError(400, str(e), param="model") from None
        if keep is not None:
            raise invalid("truncate_prompt_tokens", CROSS_ENCODER_TRUNCATION)
        prompts = list(await asyncio.gather(*(ctx.encode_pair_off_loop(texts_1[i], texts_2[j], param)
                                              for i, j in pairs)))
        outputs = await _pooled(ctx, prompts, _params(ctx), request_id, request, arrival_time)
        return [o.outputs.probs[0] for o in outputs], sum(len(o.prompt_token_ids) for o in outputs)
    prompts = await _encoded_texts(ctx, texts_1 + texts_2, param, keep)
    outputs = await _pooled(ctx, prompts, _params(ctx, truncate_prompt_tokens=keep), request_id, request, arrival_time)
    a, b = outputs[: len(texts_1)], outputs[len(texts_1):]
    return ([cosine_similarity(a[i].outputs.data, b[j].outputs.data) for i, j in pairs],
            sum(len(o.prompt_token_ids) for o in outputs))


def _task(ctx: ServingContext) -> str | None:
    pooler = ctx.engine_loop.engine.pooler
    return None if pooler is None else pooler.task


def _start(ctx: ServingContext, model: str | None, truncate_prompt_tokens: int | None, api: str,
           task: str | None = None, param: str = "model") -> int | None:
    """What every pooling endpoint checks first (the model name, a loaded pooling engine running `task`, None:
    either; a 400 naming `param` otherwise); returns the prompt tokens kept (truncate_prompt_tokens, -1 being
    max_model_len)."""
    ctx.check_model(model)
    ctx.require_ready()
    running = _task(ctx)
    if running is None or task not in (None, running):
        what = ("this server generates text; start it with --runner pooling to serve embeddings" if running is None
                else "this server's model is a sequence classifier (/classify, /score)" if running == "classify"
                else "this server's model is an embedding model (/v1/embeddings, /score)")
        raise ApiError(400, f"The model does not support {api} API: {what}", param=param)
    return ctx.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens


def _params(ctx: ServingContext, **fields) -> PoolingParams:
    try:
        params = PoolingParams(**fields)
        ctx.engine_loop.engine.pooler.check(params)
    except RequestError as e:
        raise as_api_error(e) from None
    return params


async def _pooled(ctx: ServingContext, prompts: list[list[int]], params: PoolingParams, request_id: str, request,
                  arrival_time: float | None) -> list:
    """Every prompt's EmbeddingRequestOutput (ClassificationRequestOutput), in order (one engine request each, under the request's adapter)."""
    prompts = [_checked_length(ctx, p if params.truncate_prompt_tokens is None else p[-params.truncate_prompt_tokens:])
               for p in prompts]
    generation = await ctx.generate(prompts, params, request_id, request.priority, arrival_time,
                                    ctx.lora_request(request.model))
    try:
        return await generation.final_outputs()
    finally:
        generation.abort()


def _usage(num_tokens: int) -> dict:
    return {"prompt_tokens": num_tokens, "total_tokens": num_tokens, "completion_tokens": 0, "prompt_tokens_details": None}


async def _prompts(ctx: ServingContext, request: _PoolingInput, keep: int | None) -> list[list[int]]:
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
    texts = [item for item in items if isinstance(item, str)]
    encoded = iter(await _encoded_texts(ctx, texts, "input", keep, request.add_special_tokens is not False))
    prompts = []
    for item in items:
        token_ids = next(encoded) if isinstance(item, str) else list(item)
        if not token_ids:
            raise invalid("input", "an input must give at least one token; this one gives none")
        ctx.check_token_ids(token_ids, "input")
        prompts.append(token_ids)
    return prompts


async def _encoded_texts(ctx: ServingContext, texts: list[str], param: str, keep: int | None,
                         add_special_tokens: bool = True) -> list[list[int]]:
    """The texts' token ids, tokenized off the event loop (truncate_prompt_tokens `keep`); 400 naming `param`
    for one that gives no token."""
    encoded = await asyncio.gather(*(ctx.encode_off_loop(t, add_special_tokens, param, keep) for t in texts))
    if not all(encoded):
        raise invalid(param, "a text must give at least one token; one gives none")
    return list(encoded)


def _checked_length(ctx: ServingContext, token_ids: list[int]) -> list[int]:
    """400 context_length_exceeded (vLLM's words) for an input longer than max_model_len."""
    if len(token_ids) > ctx.max_model_len:
        raise ApiError(400, f"{CONTEXT_LENGTH_PREFIX} {ctx.max_model_len} tokens. However, you requested "
                       f"{len(token_ids)} tokens in the input for embedding generation. Please reduce the length of "
                       "the input (or set truncate_prompt_tokens).", param="input", code="context_length_exceeded")
    return token_ids


def _encoded(values: torch.Tensor | list[float], encoding_format: str) -> list[float] | str:
    """An embedding (float32 tensor) or probabilities (list) as the reply's float list or base64 of little-endian
    float32 bytes."""
    if encoding_format == "float":
        return values.tolist() if isinstance(values, torch.Tensor) else values
    array = values.numpy() if isinstance(values, torch.Tensor) else np.asarray(values)  # (rows: row-major)
    return base64.b64encode(array.astype("<f4").tobytes()).decode("ascii")
