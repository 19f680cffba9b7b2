"""The HTTP server: FastAPI routes over the engine loop, served by uvicorn.

Endpoints: GET /v1/models (and /v1/models/{name}), POST /v1/completions, POST /v1/chat/completions, POST
/v1/responses (with a response store: GET and DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel,
GET /v1/responses/{id}/input_items), POST /tokenize, POST /detokenize, GET /health, GET /version, GET /metrics. With an API key, /v1/* and the
tokenizer endpoints need `Authorization: Bearer KEY`; /health, /version and /metrics stay open
(load balancers and Prometheus). The server listens at once and answers 503 until the engine has
loaded on its thread. SIGTERM stops accepting connections, lets running requests finish (up to
GRACEFUL_SHUTDOWN_S, then aborts them), stops the engine thread and returns normally.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import hmac
import logging
import os
import signal
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import llmc
from llmc.errors import ConfigError
from llmc.runtime.server.engine_loop import STALL_TIMEOUT_S, EngineLoop, EngineStopped
from llmc.runtime.server.errors import ApiError, as_api_error, error_body, invalid
from llmc.runtime.server.lora_modules import LoraModule, ServedAdapters, with_adapters
from llmc.runtime.server.metrics import ServerMetrics, log_stats_periodically
from llmc.runtime.server.router import ReplicaRouter
from llmc.runtime.server.reasoning_parsers import check_name as check_reasoning_parser
from llmc.runtime.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                          ClassificationRequest, EmbeddingRequest, PoolingRequest, RerankRequest, ResponsesRequest,
                                          ScoreRequest,
                                          TokenizeRequest, openapi_body, parse_json_body)
from llmc.runtime.server.serving import DEFAULT_MAX_WAITING, EventStream, ModelNames, ServingContext, parse_body
from llmc.runtime.server.serving_chat import create_chat_completion
from llmc.runtime.server.serving_completion import create_completion
from llmc.runtime.server.serving_embedding import create_classification, create_embedding, create_rerank, create_score
from llmc.runtime.server import serving_responses
from llmc.runtime.server.serving_responses import ResponseStore, create_response, not_found

logger = logging.getLogger("llmc")

# How long SIGTERM waits for running requests before aborting them (each cut stream gets an error event).
GRACEFUL_SHUTDOWN_S = 30
# The largest request body accepted (413 beyond).
MAX_BODY_BYTES = 8 * 2**20
# How often the watchdog looks at the engine loop.
WATCHDOG_INTERVAL_S = 5.0


@dataclasses.dataclass(frozen=True)
class CorsPolicy:
    """The CORS headers browsers get (vLLM's --allowed-origins, --allowed-methods, --allowed-headers,
    --allow-credentials): by default, as vLLM's, any origin, method and header, without credentials."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False

    def add_to(self, app: FastAPI) -> None:
        app.add_middleware(CORSMiddleware, allow_origins=list(self.allowed_origins),
                           allow_methods=list(self.allowed_methods), allow_headers=list(self.allowed_headers),
                           allow_credentials=self.allow_credentials)


def build_app(engine_factory: Callable[[], object] | list[Callable[[], object]], served_model_name: ModelNames, *,
              api_key: str | None = None, max_waiting: int | None = DEFAULT_MAX_WAITING, log_stats: bool = True,
              tokenizer_pool_size: int = 0, trust_request_chat_template: bool = False,
              on_startup_failure: Callable[[BaseException], None] | None = None,
              on_fatal: Callable[[BaseException], None] | None = None,
              stall_timeout_s: float = STALL_TIMEOUT_S, cors: CorsPolicy = CorsPolicy(),
              enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
              reasoning_parser: str | None = None, reasoning_in_structured_output: bool = False,
              log_requests: bool = False, max_log_len: int | None = None,
              enable_responses_store: bool = False, lora_modules: list[LoraModule] = ()) -> FastAPI:
    """The ASGI app. `engine_factory()` builds the Engine on the engine thread when the app starts;
    a list of factories builds one replica each (data parallelism, requests to the least loaded).
    `on_fatal` is told when an engine can never step again (a rank of a parallel engine died).
    /health answers 503 once one engine step has run `stall_timeout_s` (a wedged engine). `cors`: the
    CORS headers of every response (preflight requests included). `enable_auto_tool_choice` and
    `tool_call_parser` (vLLM's flags): tool_choice "auto" reads calls out of the output with that parser
    (runtime/server/tool_parsers.TOOL_CALL_PARSERS); ValueError for a parser name not there.
    `reasoning_parser` (vLLM's --reasoning-parser): chat replies carry the thinking apart
    (runtime/server/reasoning_parsers); `reasoning_in_structured_output`: structured output then
    constrains the whole output, reasoning included (else it is refused with a reasoning parser).
    `log_requests` (vLLM's --enable-log-requests): a line per request, prompt and ids cut at `max_log_len`.
    `enable_responses_store` (vLLM's VLLM_ENABLE_RESPONSES_API_STORE): /v1/responses keeps responses in
    memory (serving_responses.ResponseStore) for GET /v1/responses/{id} and previous_response_id.
    `lora_modules` (vLLM's --lora-modules; the engines need enable_lora): adapters served by name, read by every
    replica's engine as it loads (a bad one fails the start); a request whose model names one runs with it."""
    # checked before anything starts: a bad parser name is the caller's error, not a request's
    ServingContext.check_tool_options(enable_auto_tool_choice, tool_call_parser)
    check_reasoning_parser(reasoning_parser)
    metrics = ServerMetrics(served_model_name if isinstance(served_model_name, str) else served_model_name[0])
    factories = engine_factory if isinstance(engine_factory, list) else [engine_factory]
    first_name = served_model_name if isinstance(served_model_name, str) else served_model_name[0]
    adapters = ServedAdapters(list(lora_modules), default_base=first_name)
    if adapters:
        factories = [with_adapters(factory, adapters) for factory in factories]
    loops = [EngineLoop(factory, observer=metrics, on_fatal=on_fatal) for factory in factories]
    engine_loop = loops[0] if len(loops) == 1 else ReplicaRouter(loops)
    metrics.attach(engine_loop)
    ctx = ServingContext(engine_loop, served_model_name, max_waiting, tokenizer_pool_size, trust_request_chat_template,
                         enable_auto_tool_choice, tool_call_parser, reasoning_parser, reasoning_in_structured_output,
                         log_requests, max_log_len, adapters)
    ctx.stall_timeout_s = stall_timeout_s

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine_loop.start()
        tasks = [asyncio.create_task(_announce_ready(ctx, on_startup_failure)),
                 asyncio.create_task(_watchdog(ctx))]
        if log_stats:
            tasks.append(asyncio.create_task(log_stats_periodically(metrics, engine_loop)))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            if ctx.response_store is not None:
                ctx.response_store.stop_all()  # background responses still generating
            await engine_loop.shutdown()
            ctx.close()

    app = FastAPI(title="llmc", version=llmc.__version__, lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    app.state.metrics = metrics
    cors.add_to(app)
    _add_error_handlers(app)
    app.include_router(_open_routes(ctx, metrics))
    # vLLM's VLLM_ENABLE_RESPONSES_API_STORE: None keeps nothing
    ctx.response_store = ResponseStore() if enable_responses_store else None
    app.include_router(_api_routes(ctx), dependencies=[Depends(_api_key_check(api_key))])
    return app


async def _announce_ready(ctx: ServingContext, on_startup_failure) -> None:
    try:
        await ctx.engine_loop.wait_ready()
    except Exception as e:  # noqa: BLE001 - reported by whoever runs the server
        logger.error("the engine failed to start: %s", e)
        if on_startup_failure is not None:
            on_startup_failure(e)
        return
    stats = ctx.engine_loop.stats
    logger.info("ready: serving %r (max_model_len %d, %d KV blocks)", ctx.served_model_name, ctx.max_model_len,
                stats.get("num_total_blocks", 0))


async def _watchdog(ctx: ServingContext) -> None:
    """Log, once per episode, when the engine stops serving (a step running too long, a dead
    thread, steps that keep failing), and when it serves again."""
    reported = None
    while True:
        await asyncio.sleep(min(WATCHDOG_INTERVAL_S, ctx.stall_timeout_s / 2))
        problem = _health_problem(ctx) if ctx.engine_loop.is_ready else None
        if problem is not None and reported is None:
            logger.error("watchdog: the engine is not serving: %s; /health answers 503", problem)
        elif problem is None and reported is not None:
            logger.warning("watchdog: the engine is stepping again")
        reported = problem


def _health_problem(ctx: ServingContext) -> str | None:
    problems = [loop.health_problem(ctx.stall_timeout_s) for loop in ctx.engine_loop.replicas]
    return next((p for p in problems if p is not None), None)


def _open_routes(ctx: ServingContext, metrics: ServerMetrics) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    @router.get("/ping")  # vLLM's (SageMaker's) name for the same check, GET or POST
    @router.post("/ping")
    async def health() -> Response:
        ctx.require_ready()
        problem = _health_problem(ctx)
        if problem is not None:
            return JSONResponse(error_body(503, f"unhealthy: {problem}"), status_code=503)
        return Response(status_code=200)

    @router.get("/version")
    async def version() -> dict:
        return {"version": llmc.__version__}

    @router.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router


def _api_routes(ctx: ServingContext) -> APIRouter:
    router = APIRouter()

    def model_card(name: str) -> dict:
        ctx.require_ready()
        lora = ctx.lora_request(name)
        if lora is not None:  # a LoRA adapter (--lora-modules), as vLLM lists one: its path, its base model
            return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "llmc",
                    "root": lora.lora_path, "parent": ctx.adapters.parents[name], "max_model_len": ctx.max_model_len}
        # No filesystem path: `root` is the served name (a client has no business with the server's paths).
        return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "llmc",
                "root": name, "parent": None, "max_model_len": ctx.max_model_len}

    @router.get("/v1/models")
    async def models() -> dict:  # every served name, then the adapters, as vLLM lists them
        names = [*ctx.served_model_names, *ctx.adapters.requests]
        return {"object": "list", "data": [model_card(name) for name in names]}

    @router.post("/v1/load_lora_adapter")  # vLLM's, behind VLLM_ALLOW_RUNTIME_LORA_UPDATING
    async def load_lora_adapter(request: Request) -> Response:
        body = await _json_body(request)
        name, path = _adapter_fields(ctx, body, ("lora_name", "lora_path"))
        if name in ctx.adapters or name in ctx.served_model_names:
            raise invalid("lora_name", f"the model {name!r} is already served; unload it first, or choose another name")
        lora = ctx.adapters.next_request(name, path)
        ctx.require_ready()
        try:  # every replica reads and checks it (a bad folder or rank is this request's 400)
            for replica in ctx.engine_loop.replicas:
                await replica.read_adapter(lora)
        except Exception as e:  # noqa: BLE001 - RequestError: the adapter's problem
            raise _as_load_error(e) from None
        if name in ctx.adapters:  # loaded meanwhile by a concurrent request
            raise invalid("lora_name", f"the model {name!r} is already served; unload it first")
        ctx.adapters.add(name, path)
        logger.info("LoRA adapter %r loaded from %s (id %d)", name, path, lora.lora_int_id)
        return Response(f"Success: LoRA adapter '{name}' added successfully.", media_type="text/plain")

    @router.post("/v1/unload_lora_adapter")  # vLLM's, behind VLLM_ALLOW_RUNTIME_LORA_UPDATING
    async def unload_lora_adapter(request: Request) -> Response:
        body = await _json_body(request)
        (name,) = _adapter_fields(ctx, body, ("lora_name",))
        lora = ctx.lora_request(name)
        if lora is None:
            raise ApiError(404, f"the LoRA adapter {name!r} is not served (GET /v1/models lists them)",
                           param="lora_name", code="model_not_found")
        running = sum([await replica.num_lora_requests(lora.lora_int_id) for replica in ctx.engine_loop.replicas])
        if running:
            raise invalid("lora_name", f"the LoRA adapter {name!r} has {running} unfinished request(s); unload it "
                          "once they are done")
        ctx.adapters.remove(name)
        logger.info("LoRA adapter %r unloaded (id %d)", name, lora.lora_int_id)
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", media_type="text/plain")

    if os.environ.get(DEV_MODE_ENV, "").strip().lower() in ("1", "true"):
        @router.post("/reset_prefix_cache")  # vLLM's development endpoint, only under VLLM_SERVER_DEV_MODE=1
        async def reset_prefix_cache() -> Response:
            ctx.require_ready()
            busy = [i for i, replica in enumerate(ctx.engine_loop.replicas) if not await replica.reset_prefix_cache()]
            if busy:
                raise ApiError(409, "the prefix cache is in use by running requests and was not reset"
                               + (f" on replica(s) {busy}" if len(ctx.engine_loop.replicas) > 1 else "")
                               + "; retry when they are done")
            return Response(status_code=200)

    @router.get("/v1/models/{model:path}")  # OpenAI's retrieve (client.models.retrieve); a name may hold "/"
    async def model(model: str) -> dict:
        ctx.check_model(model)
        return model_card(ctx.response_model(model))

    @router.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        arrival_time = time.monotonic()
        return await _generate(request, lambda body: create_completion(ctx, body, arrival_time))

    @router.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        arrival_time = time.monotonic()
        return await _generate(request, lambda body: create_chat_completion(ctx, body, arrival_time))

    @router.post("/v1/embeddings", openapi_extra=openapi_body(EmbeddingRequest))
    async def embeddings(request: Request) -> Response:
        arrival_time = time.monotonic()
        return await _generate(request, lambda body: create_embedding(ctx, body, arrival_time))

    @router.post("/pooling", openapi_extra=openapi_body(PoolingRequest))  # vLLM's: the embeddings, its reply's names
    async def pooling(request: Request) -> Response:
        arrival_time = time.monotonic()
        return await _generate(request, lambda body: create_embedding(ctx, body, arrival_time, pooling=True))

    @router.post("/classify", openapi_extra=openapi_body(ClassificationRequest))  # vLLM's, on a sequence classifier
    @router.post("/v1/classify", openapi_extra=openapi_body(ClassificationRequest))
    async def classify(request: Request) -> Response:
        arrival_time = time.monotonic()
        return await _generate(request, lambda body: create_classification(ctx, body, arrival_time))

    @router.post("/score", openapi_extra=openapi_body(ScoreRequest))  # vLLM's: embedding models and cross-encoders
    @router.post("/v1/score", openapi_extra=openapi_body(ScoreRequest))
    async def score(request: Request) -> Response:
        arrival_time = time.monotonic()
        return await _generate(request, lambda body: create_score(ctx, body, arrival_time))

    @router.post("/rerank", openapi_extra=openapi_body(RerankRequest))  # vLLM's (Jina's, Cohere's v1 and v2 forms)
    @router.post("/v1/rerank", openapi_extra=openapi_body(RerankRequest))
    @router.post("/v2/rerank", openapi_extra=openapi_body(RerankRequest))
    async def rerank(request: Request) -> Response:
        arrival_time = time.monotonic()
        return await _generate(request, lambda body: create_rerank(ctx, body, arrival_time))

    @router.post("/v1/responses", openapi_extra=openapi_body(ResponsesRequest))
    async def responses(request: Request) -> Response:
        arrival_time = time.monotonic()
        return await _generate(request, lambda body: create_response(ctx, body, arrival_time))

    @router.get("/v1/responses/{response_id}")  # client.responses.retrieve: a kept response, done or not
    async def retrieve_response(response_id: str, request: Request) -> dict:
        return serving_responses.retrieve_response(ctx, response_id, dict(request.query_params))

    @router.post("/v1/responses/{response_id}/cancel")  # client.responses.cancel: a background response
    async def cancel_response(response_id: str) -> dict:
        return serving_responses.cancel_response(ctx, response_id)

    @router.get("/v1/responses/{response_id}/input_items")  # client.responses.input_items.list
    async def list_input_items(response_id: str, request: Request) -> dict:
        return serving_responses.list_input_items(ctx, response_id, request.query_params.multi_items())

    @router.delete("/v1/responses/{response_id}")  # client.responses.delete: dropped from the store
    async def delete_response(response_id: str) -> dict:
        store = ctx.response_store
        if store is None or not store.delete(response_id):
            raise not_found(response_id, "response_id", store)
        return {"id": response_id, "object": "response", "deleted": True}

    @router.post("/tokenize", openapi_extra=openapi_body(TokenizeRequest))
    async def tokenize(request: Request) -> dict:
        body = parse_body(TokenizeRequest, await _json_body(request))
        body.check()
        ctx.check_model(body.model)
        ctx.require_ready()
        if body.messages is not None:  # add_special_tokens: on top of the template's, off unless asked (vLLM's)
            messages = [m.as_template_input(i) for i, m in enumerate(body.messages)]
            options = body.template_options() | {"add_special_tokens": bool(body.add_special_tokens)}
            token_ids = await asyncio.to_thread(ctx.render_chat, messages, options)
        else:
            add_special = True if body.add_special_tokens is None else body.add_special_tokens
            token_ids = await asyncio.to_thread(ctx.encode, body.prompt, add_special)
        token_strs = ctx.tokenizer.convert_ids_to_tokens(token_ids) if body.return_token_strs else None
        return {"count": len(token_ids), "max_model_len": ctx.max_model_len, "tokens": token_ids,
                "token_strs": token_strs}

    @router.post("/detokenize", openapi_extra=openapi_body(DetokenizeRequest))
    async def detokenize(request: Request) -> dict:
        body = parse_body(DetokenizeRequest, await _json_body(request))
        ctx.check_model(body.model)
        ctx.require_ready()
        ctx.check_token_ids(body.tokens, "tokens")
        return {"prompt": ctx.tokenizer.decode(body.tokens)}

    return router


# vLLM's switch for /v1/load_lora_adapter and /v1/unload_lora_adapter
RUNTIME_LORA_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
# vLLM's switch for its development endpoints (here /reset_prefix_cache)
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


def _adapter_fields(ctx: ServingContext, body: object, names: tuple[str, ...]) -> list[str]:
    """The body's string fields `names` of a load/unload request, once the server allows them: started with
    --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (vLLM's gate); else a 400 naming --lora-modules."""
    if os.environ.get(RUNTIME_LORA_UPDATING_ENV, "").strip().lower() not in ("1", "true"):
        raise ApiError(400, "loading and unloading LoRA adapters at run time is off: serve adapters with "
                       f"--enable-lora --lora-modules NAME=PATH, or start the server with {RUNTIME_LORA_UPDATING_ENV}=1 "
                       "(and --enable-lora) to allow these endpoints (vLLM's switch)")
    engine = ctx.engine_loop.engine
    if engine is not None and not engine.options.enable_lora:
        raise ApiError(400, "run-time LoRA is off on this server: start it with --enable-lora (and serve adapters "
                       "with --lora-modules NAME=PATH, or load them here)")
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    values = []
    for name in names:
        value = body.get(name)
        if not isinstance(value, str) or not value:
            raise invalid(name, "give a non-empty string")
        values.append(value)
    return values


def _as_load_error(error: Exception) -> ApiError:
    from llmc.errors import RequestError

    if isinstance(error, RequestError):
        return ApiError(400, str(error), param="lora_path")
    return as_api_error(error)


async def _generate(request: Request, handle: Callable[[object], Awaitable[dict | EventStream]]) -> Response:
    """Run a generation handler; a client that goes away before the reply has its requests aborted
    (a streaming reply notices the disconnect itself, see StreamingResponse)."""
    body = await _json_body(request)
    handler = asyncio.ensure_future(handle(body))
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if not handler.done():
        handler.cancel()  # its `finally` aborts the engine requests
        return Response(status_code=499)
    watcher.cancel()
    result = handler.result()
    if isinstance(result, dict):
        return JSONResponse(result)
    return ClosingStreamingResponse(result.events, result.close, media_type="text/event-stream",
                                    headers={"Cache-Control": "no-cache"})


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that calls `on_close` once it is over, sent, failed or cancelled (serving.EventStream)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _json_body(request: Request) -> object:
    """The parsed JSON body; 400 for a body sent as another media type (vLLM's rule), not JSON, nested
    deeper than MAX_JSON_DEPTH or holding a lone UTF-16 surrogate; 413 beyond MAX_BODY_BYTES."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(400, f"unsupported media type {media_type or '(none)'!r}: send the body as JSON with "
                       "'Content-Type: application/json'")
    raw = await _read_body(request)
    return await asyncio.to_thread(parse_json_body, raw)  # a large body must not stall the event loop


async def _read_body(request: Request) -> bytes:
    too_large = ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes; send a smaller request")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _api_key_check(api_key: str | None):
    expected = f"Bearer {api_key}".encode() if api_key else None

    async def check(request: Request) -> None:
        if expected is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise ApiError(401, "invalid API key: send the server's key as 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    return check


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(error.status_code, str(error.detail)), status_code=error.status_code,
                            headers=error.headers)  # a 405's Allow

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(400, str(error)), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, error: Exception) -> JSONResponse:
        logger.exception("internal error while handling a request")
        return JSONResponse(error_body(500, f"internal error: {type(error).__name__}: {error}"), status_code=500)


def serve(engine_factory: Callable[[], object] | list[Callable[[], object]], served_model_name: ModelNames, *, host: str = "127.0.0.1",
          port: int = 8000, api_key: str | None = None, max_waiting: int | None = DEFAULT_MAX_WAITING,
          log_stats: bool = True, tokenizer_pool_size: int = 0, shutdown_timeout_s: float = GRACEFUL_SHUTDOWN_S,
          trust_request_chat_template: bool = False, cors: CorsPolicy = CorsPolicy(),
          enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
          reasoning_parser: str | None = None, reasoning_in_structured_output: bool = False,
          tls: TlsConfig | None = None, root_path: str = "", uvicorn_log_level: str = "info",
          access_log: bool = True, log_requests: bool = False, max_log_len: int | None = None,
          enable_responses_store: bool = False, lora_modules: list[LoraModule] = ()) -> None:
    """Serve until SIGTERM or Ctrl-C; raise what the engine raised if it could not start or stopped
    for good (a rank of a parallel engine died). On SIGTERM running requests get `shutdown_timeout_s`
    to finish; then they are aborted, and each cut stream ends with an error event and [DONE].
    vLLM's deployment options: `tls` (HTTPS), `root_path` (the prefix a proxy serves the API under),
    uvicorn's log level and access log."""
    startup_errors: list[BaseException] = []

    def on_startup_failure(error: BaseException) -> None:
        startup_errors.append(error)
        server.should_exit = True

    app = build_app(engine_factory, served_model_name, api_key=api_key, max_waiting=max_waiting,
                    log_stats=log_stats, tokenizer_pool_size=tokenizer_pool_size,
                    trust_request_chat_template=trust_request_chat_template, on_startup_failure=on_startup_failure,
                    on_fatal=on_startup_failure, cors=cors, enable_auto_tool_choice=enable_auto_tool_choice,
                    tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
                    reasoning_in_structured_output=reasoning_in_structured_output, log_requests=log_requests,
                    max_log_len=max_log_len, enable_responses_store=enable_responses_store,
                    lora_modules=lora_modules)  # a dead rank ends the server, and `serve` raises its error
    sock = bind_socket(host, port)  # before the model loads, as vLLM does: a port in use fails at once
    # uvicorn cancels what is left a little after our own abort: the aborted streams finish first.
    config = uvicorn.Config(app, host=host, port=port, log_config=None, log_level=uvicorn_log_level,
                            access_log=access_log, root_path=root_path,
                            timeout_graceful_shutdown=shutdown_timeout_s + 10, **(tls.uvicorn_keywords() if tls else {}))
    server = _Server(config, app.state.ctx.engine_loop, shutdown_timeout_s)
    behind = f", {root_path}/v1 behind the proxy" if root_path else ""
    logger.info("listening on %s (OpenAI API under /v1%s); loading the model",
                server_url(host, sock.getsockname()[1], https=tls is not None), behind)
    with sock, _sigterm_handled_by_uvicorn():
        server.run(sockets=[sock])
    if startup_errors:
        raise startup_errors[0]


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound to (host, port) as uvicorn binds it (IPv6 where the host has a
    ':', else IPv4: a name such as localhost means its IPv4 address, even where the resolver lists ::1
    first; "" means every IPv4 interface); one ConfigError line if it cannot be."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds (restarts over TIME_WAIT)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if isinstance(e, socket.gaierror) or e.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(f"--host {host!r}: not an address of this machine ({e.strerror}); use 127.0.0.1, "
                              "0.0.0.0 or a local address") from None
        what = "is in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
        raise ConfigError(f"port {port} on {host} {what}; choose another with --port, or stop what holds it") from None
    sock.listen(2048)  # uvicorn's default backlog
    sock.set_inheritable(True)
    return sock


def server_url(host: str, port: int, https: bool = False) -> str:
    """http://host:port (https://), an IPv6 host in brackets (RFC 3986)."""
    scheme = "https" if https else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


@dataclasses.dataclass(frozen=True)
class TlsConfig:
    """vLLM's --ssl-keyfile, --ssl-certfile, --ssl-ca-certs and --ssl-cert-reqs (uvicorn's)."""

    keyfile: str
    certfile: str
    ca_certs: str | None = None
    cert_reqs: int = int(ssl.CERT_NONE)  # 2 (CERT_REQUIRED): clients must present a certificate ca_certs signs

    def check(self) -> None:
        """Load the key, certificate and CA files as uvicorn will, so a wrong one fails before the port is
        bound and the model loads, in one line."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(self.certfile, self.keyfile)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"--ssl-certfile {self.certfile} with --ssl-keyfile {self.keyfile}: not a usable "
                              f"certificate and private key ({getattr(e, 'strerror', None) or e}); give PEM "
                              "files of one key pair") from None
        if self.ca_certs is not None:
            try:
                context.load_verify_locations(self.ca_certs)
            except (OSError, ssl.SSLError) as e:
                raise ConfigError(f"--ssl-ca-certs {self.ca_certs}: not a usable CA bundle "
                                  f"({getattr(e, 'strerror', None) or e}); give a PEM file") from None
        if self.cert_reqs == ssl.CERT_REQUIRED and self.ca_certs is None:
            raise ConfigError("--ssl-cert-reqs 2 asks clients for certificates: give --ssl-ca-certs to check them with")

    def uvicorn_keywords(self) -> dict:
        return {"ssl_keyfile": self.keyfile, "ssl_certfile": self.certfile, "ssl_ca_certs": self.ca_certs,
                "ssl_cert_reqs": self.cert_reqs}


class _Server(uvicorn.Server):
    """uvicorn's server, which past the grace period aborts the requests still running (their
    streams send an error event and [DONE]) instead of cutting their connections."""

    def __init__(self, config, engine_loop, grace_s: float):
        super().__init__(config)
        self._engine_loop = engine_loop
        self._grace_s = grace_s

    async def shutdown(self, sockets=None) -> None:
        def abort_running() -> None:
            logger.warning("shutdown: aborting the requests still running after %g s", self._grace_s)
            self._engine_loop.abort_all(EngineStopped(
                f"the server is shutting down and the request did not finish within {self._grace_s:g} s"))

        timer = asyncio.get_running_loop().call_later(self._grace_s, abort_running)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


class _sigterm_handled_by_uvicorn:
    """uvicorn shuts down gracefully on SIGTERM and then re-raises the signal to the handler that
    was installed before it; install a no-op one, so that a graceful shutdown exits with 0."""

    def __enter__(self):
        self.is_main = threading.current_thread() is threading.main_thread()
        if self.is_main:
            self.previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)

    def __exit__(self, *exc_info):
        if self.is_main:
            signal.signal(signal.SIGTERM, self.previous)
