"""What every endpoint shares: the model-name and readiness checks, prompt rendering and
checking, admission (the waiting-queue limit) and `Generation`, the handle of one API request's
engine requests (a completion with several prompts is several engine requests)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from torch import Tensor

from llmc.errors import RequestError

from llmc.runtime.outputs import RequestOutput
from llmc.runtime.prompt_embeds import check_prompt_embeds, decode_prompt_embeds
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.server.engine_loop import STALL_TIMEOUT_S, EngineLoop, EngineStopped, RequestFailed, RequestStream
from llmc.runtime.server.errors import ApiError, as_api_error, invalid, unavailable
from llmc.runtime.server.lora_modules import ServedAdapters
from llmc.runtime.server.protocol import MAX_LOGPROBS
from llmc.runtime.server.harmony import check_flags as check_harmony_flags
from llmc.runtime.server.reasoning_parsers import check_name as check_reasoning_parser
from llmc.runtime.server.tool_parsers import TOOL_CALL_PARSERS, unknown_parser
from llmc.runtime.tokenizer import apply_chat_template, encode_pair, encode_text

logger = logging.getLogger("llmc")

Body = TypeVar("Body", bound=BaseModel)
# The names clients may send as `model` (vLLM's --served-model-name a b): one, or several (the first is the main one).
ModelNames = str | Sequence[str]

# Sequences that may wait for a seat before new requests get 503 (`llmc run --max-waiting`).
DEFAULT_MAX_WAITING = 1024
# How OpenAI's and vLLM's context-length errors begin: clients (LiteLLM, ...) match this prefix, case and all.
CONTEXT_LENGTH_PREFIX = "This model's maximum context length is"


def parse_body(model: type[Body], body: object) -> Body:
    """Validate a JSON body; a bad field is a 400 naming it. Unknown fields are logged and ignored."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        parsed = model.model_validate(body)
    except ValidationError as e:
        raise as_api_error(e) from None
    unknown = parsed.unknown_fields() if hasattr(parsed, "unknown_fields") else []
    if unknown:
        logger.warning("ignoring unknown request field(s): %s", ", ".join(unknown))
    return parsed


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def parse_generation_request(ctx: "ServingContext", model: type[Body], body: object):
    """What completions and chat share before generating: the body checked, the model and the engine
    ready, the sampling parameters built. Returns (request, SamplingParams)."""
    request = parse_body(model, body)
    engine = ctx.engine_loop.engine
    request.check(engine.max_logprobs if engine is not None else MAX_LOGPROBS)
    ctx.check_model(request.model)
    ctx.require_ready()
    if request.truncate_prompt_tokens == -1:  # vLLM's: keep the last max_model_len tokens
        request.truncate_prompt_tokens = ctx.max_model_len
    try:
        return request, request.to_sampling_params(ctx.engine_loop.engine.default_sampling_fields)
    except RequestError as e:
        raise as_api_error(e) from None


@dataclass
class EventStream:
    """A streaming reply: its SSE events, and what ends its engine requests however the response ends.

    The events' own `finally` aborts them too, but only once iterated: when the client is gone before the
    first chunk, Starlette may never start the iterator (cancelled while it waits, or `send` failing on the
    response's start), and an async generator that never started runs no `finally`. So the server calls
    `close` after the response in every case (api_server.ClosingStreamingResponse); it must be idempotent."""

    events: AsyncIterator[str]
    close: Callable[[], None]


async def respond(generation: "Generation", reply, is_stream: bool):
    """An EventStream (stream), or the whole response once every output is final; a
    non-streaming request that fails or is cancelled is aborted so its KV blocks come back."""
    if is_stream:
        return EventStream(reply.stream(generation), generation.abort)
    try:
        outputs = await generation.final_outputs()
    finally:
        generation.abort()
    return reply.response(outputs)


class ServingContext:
    """The engine loop plus the server's settings, as the handlers need them."""

    def __init__(self, engine_loop: EngineLoop, served_model_name: ModelNames, max_waiting: int | None = DEFAULT_MAX_WAITING,
                 tokenizer_pool_size: int = 0, trust_request_chat_template: bool = False,
                 enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None, reasoning_in_structured_output: bool = False,
                 log_requests: bool = False, max_log_len: int | None = None,
                 adapters: ServedAdapters | None = None):
        self.engine_loop = engine_loop
        # vLLM's --enable-log-requests: one INFO line per request (its id, the prompt's text and token ids, at
        # most max_log_len of each, and the sampling parameters)
        self.log_requests = log_requests
        self.max_log_len = max_log_len
        # vLLM's --reasoning-parser: chat replies carry the thinking apart (reasoning_parsers); with
        # reasoning_in_structured_output (vLLM's structured_outputs_config enable_in_reasoning) an output
        # constraint covers the whole output, reasoning included, else it is refused with the parser
        check_reasoning_parser(reasoning_parser)
        self.reasoning_parser = reasoning_parser
        self.reasoning_in_structured_output = reasoning_in_structured_output
        # vLLM's --enable-auto-tool-choice and --tool-call-parser: tool_choice "auto" (the default with tools)
        # reads calls out of the output with that parser; refused without them
        self.check_tool_options(enable_auto_tool_choice, tool_call_parser)
        check_harmony_flags(tool_call_parser, reasoning_parser)  # gpt-oss's parsers go together (harmony.py)
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_call_parser = tool_call_parser
        self.served_model_names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
        self.served_model_name = self.served_model_names[0]  # metrics' and logs' name
        # vLLM's --lora-modules: a request whose model is an adapter's name runs with it (lora_modules.py)
        self.adapters = adapters if adapters is not None else ServedAdapters(default_base=self.served_model_name)
        self.max_waiting = max_waiting
        # vLLM's --trust-request-chat-template: a request's own chat_template (Jinja the server renders) is
        # refused unless the server was started with it
        self.trust_request_chat_template = trust_request_chat_template
        self.stall_timeout_s = STALL_TIMEOUT_S  # /health: 503 once one step has run this long
        # /v1/responses' kept responses (serving_responses.ResponseStore; build_app's enable_responses_store), or None
        self.response_store = None
        # tokenizer_pool_size > 0: prompts are tokenized and chat templates rendered on these threads
        # (fast tokenizers release the GIL); 0: on the event loop's default thread pool — never on
        # the loop itself, where a big prompt would stall every stream and /health
        self._tokenizer_pool = (ThreadPoolExecutor(tokenizer_pool_size, thread_name_prefix="llmc-tokenizer")
                                if tokenizer_pool_size > 0 else None)

    def close(self) -> None:
        if self._tokenizer_pool is not None:
            self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    # ---- checks ----------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        """404 for a name not served (the base model's names and the LoRA adapters'); none or "" means the
        served model (as vLLM reads it)."""
        if model and model not in self.served_model_names and model not in self.adapters:
            names = ", ".join(map(repr, [*self.served_model_names, *self.adapters.requests]))
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {names}",
                           param="model", code="model_not_found")

    def lora_request(self, model: str | None):
        """The LoRARequest of the adapter `model` names (--lora-modules), else None (the base model)."""
        return self.adapters.get(model)

    def response_model(self, model: str | None) -> str:
        """The `model` of a response: the name the request sent (one of the served names), else the first (vLLM's)."""
        return model or self.served_model_name

    @staticmethod
    def check_tool_options(enable_auto_tool_choice: bool, tool_call_parser: str | None) -> None:
        """ValueError for a parser name llmc does not have, or auto tool choice without a parser (vLLM's)."""
        if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(unknown_parser(tool_call_parser))
        if enable_auto_tool_choice and tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")

    def check_tool_choice(self, tool_mode: str | None) -> None:
        """400 for tool_choice "auto" (the default when tools are given) on a server started without
        --enable-auto-tool-choice and --tool-call-parser (vLLM's rule)."""
        if tool_mode == "auto" and not (self.enable_auto_tool_choice and self.tool_call_parser):
            raise invalid("tool_choice", '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                          'to be set (tool_choice is "auto" when tools are given without it); send tool_choice "none", '
                          '"required" or a named function, or run llmc with both flags (the server, or a batch file)')

    def require_ready(self) -> None:
        if not self.engine_loop.is_ready:
            raise unavailable("the model is still loading; retry in a moment")

    def check_admission(self, num_sequences: int, param: str) -> None:
        """400 for a request that could never be admitted; 503 (Retry-After) when admitting it now
        would leave more than max_waiting sequences waiting for a seat (--max-waiting). Sequences
        count: n / best_of sequences per prompt; the free seats (max_num_seqs) wait for nothing."""
        if self.max_waiting is None:
            return
        seats = self.engine_loop.num_seats
        if num_sequences > seats + self.max_waiting:
            raise invalid(param, f"this request generates {num_sequences} sequences, but the server runs "
                          f"{seats} at once and lets at most {self.max_waiting} wait (--max-waiting): it can "
                          "never be admitted; lower n / best_of or send fewer prompts per request")
        waiting = self.engine_loop.num_unfinished_sequences + num_sequences - seats
        if waiting > self.max_waiting:
            raise unavailable(f"the server is overloaded ({self.engine_loop.num_waiting} sequences waiting, the "
                              f"limit is {self.max_waiting}); retry later")

    # ---- prompts ---------------------------------------------------------------------------

    @property
    def tokenizer(self):
        return self.engine_loop.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine_loop.engine.options.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine_loop.engine.manifest.model.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt",
               keep: int | None = None) -> list[int]:
        """`keep`: truncate_prompt_tokens (tokenizer.encode_text)."""
        try:
            return encode_text(self.tokenizer, text, add_special_tokens, keep)
        except Exception as e:  # noqa: BLE001 - the tokenizer's own types (a text it cannot encode)
            raise invalid(param, f"cannot be tokenized: {type(e).__name__}: {e}") from None

    async def encode_off_loop(self, text: str, add_special_tokens: bool = True, param: str = "prompt",
                              keep: int | None = None) -> list[int]:
        """`encode` on the tokenizer pool (the default thread pool without one)."""
        return await self._off_loop(self.encode, text, add_special_tokens, param, keep)

    async def encode_pair_off_loop(self, text_1: str, text_2: str, param: str) -> list[int]:
        """A cross-encoder's pair (tokenizer.encode_pair) on the tokenizer pool; 400 naming `param` for texts that
        cannot be tokenized."""
        return await self._off_loop(self._encode_pair, text_1, text_2, param)

    def _encode_pair(self, text_1: str, text_2: str, param: str) -> list[int]:
        try:
            return encode_pair(self.tokenizer, text_1, text_2)
        except Exception as e:  # noqa: BLE001 - the tokenizer's own types
            raise invalid(param, f"cannot be tokenized: {type(e).__name__}: {e}") from None

    async def decode_prompt_embeds_off_loop(self, data: object, where: str) -> Tensor:
        """One base64 `prompt_embeds` item decoded and checked (runtime/prompt_embeds.py) on the tokenizer pool:
        torch.load of a long prompt's rows (8 MB for 512 rows of 4096 floats) would hold the event loop."""
        return await self._off_loop(self._decode_prompt_embeds, data, where)

    def _decode_prompt_embeds(self, data: object, where: str) -> Tensor:
        hidden_size = self.engine_loop.engine.manifest.model.hidden_size
        return check_prompt_embeds(decode_prompt_embeds(data, where), hidden_size, where)

    async def render_chat_off_loop(self, messages: list[dict], options: dict | None = None) -> list[int]:
        """`render_chat` on the tokenizer pool (the default thread pool without one)."""
        return await self._off_loop(self.render_chat, messages, options)

    async def run_off_loop(self, function, *args):
        """`function(*args)` on the tokenizer pool (the default thread pool without one)."""
        return await self._off_loop(function, *args)

    async def _off_loop(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, function, *args)

    def render_chat(self, messages: list[dict], options: dict | None = None) -> list[int]:
        """`options`: apply_chat_template's keywords (add_generation_prompt, continue_final_message,
        chat_template, chat_template_kwargs, add_special_tokens)."""
        if (options or {}).get("chat_template") is not None and not self.trust_request_chat_template:
            raise invalid("chat_template", "this server does not render chat templates sent in requests; start it "
                          "with --trust-request-chat-template to allow them, or leave chat_template out")
        try:
            return apply_chat_template(self.tokenizer, messages, **(options or {}))
        except ApiError:
            raise
        except RequestError as e:  # its message starts with the field it is about, else it is about messages
            raise _chat_template_error(str(e)) from None
        except Exception as e:  # noqa: BLE001 - jinja raises its own types for a bad conversation
            raise invalid("messages", f"the chat template cannot render them: {e}") from None

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise invalid(param, f"token id {bad[0]} is out of vocabulary (ids must be in [0, {self.vocab_size}))")

    def check_prompt_length(self, token_ids: list[int], params: SamplingParams, param: str,
                            max_tokens: int | None, max_tokens_param: str = "max_tokens") -> None:
        """400 `context_length_exceeded` (vLLM's rule) when the prompt leaves no room to generate, or the
        prompt plus the requested `max_tokens` is longer than max_model_len. Without max_tokens the
        engine generates up to the context's end."""
        num_tokens = len(token_ids)
        if params.truncate_prompt_tokens is not None:
            num_tokens = min(num_tokens, params.truncate_prompt_tokens)
        if num_tokens >= self.max_model_len:
            raise ApiError(
                400, f"{CONTEXT_LENGTH_PREFIX} {self.max_model_len} tokens. However, you requested {num_tokens} "
                f"tokens in the {param}, which leaves no room for the completion. Please reduce the length of the "
                f"{param}.",
                param=param, code="context_length_exceeded",
            )
        if max_tokens is not None and num_tokens + max_tokens > self.max_model_len:
            raise ApiError(
                400, f"{CONTEXT_LENGTH_PREFIX} {self.max_model_len} tokens. However, you requested "
                f"{num_tokens + max_tokens} tokens ({num_tokens} in the {param}, {max_tokens} in the completion). "
                f"Please reduce the length of the {param} or completion ({max_tokens_param} at most "
                f"{self.max_model_len - num_tokens} here).",
                param=max_tokens_param, code="context_length_exceeded",
            )

    # ---- generation ------------------------------------------------------------------------

    async def generate(self, prompts: list[list[int] | Tensor], params: SamplingParams, request_id: str,
                       priority: int = 0, arrival_time: float | None = None, lora_request=None,
                       multi_modal_data: dict | None = None, cache_salt: str | None = None) -> Generation:
        """Queue one engine request per prompt (ids `request_id-i`), each token ids or a prompt's embeddings
        (enable_prompt_embeds); all or none are added. `lora_request`:
        the adapter they run with (`lora_request(model)`), None for the base model. `multi_modal_data`: the
        images of a one-prompt chat (Engine.add_request's)."""
        self.require_ready()
        per_prompt = params.best_of or params.n
        self.check_admission(per_prompt * len(prompts),
                             "prompt" if len(prompts) > 1 else ("best_of" if params.best_of else "n"))
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        if self.log_requests:
            for index, token_ids in enumerate(prompts):
                self._log_request(f"{request_id}-{index}", token_ids, params)
        generation = Generation(self.engine_loop)
        try:
            for index, token_ids in enumerate(prompts):
                stream = RequestStream(f"{request_id}-{index}", generation.queue, index, arrival_time,
                                       lora_int_id=None if lora_request is None else lora_request.lora_int_id)
                generation.streams.append(stream)
                await self.engine_loop.add_request(stream, token_ids, params, priority, lora_request, multi_modal_data,
                                                   cache_salt)
        except BaseException as e:
            generation.abort()
            if isinstance(e, Exception):
                raise as_api_error(e) from None
            raise
        return generation


    def _log_request(self, request_id: str, token_ids: list[int] | Tensor, params: SamplingParams) -> None:
        if isinstance(token_ids, Tensor):  # a prompt given as embeddings (runtime/prompt_embeds.py)
            logger.info("received request %s: prompt_embeds of shape %s, params: %s", request_id,
                        list(token_ids.shape), params)
            return
        limit = self.max_log_len
        ids = token_ids if limit is None else token_ids[:limit]
        text = self.tokenizer.decode(ids)
        logger.info("received request %s: prompt: %r, params: %s, prompt_token_ids: %s%s", request_id,
                    text if limit is None else text[:limit], params, ids,
                    "" if len(ids) == len(token_ids) else f" (first {len(ids)} of {len(token_ids)})")


def _chat_template_error(message: str) -> ApiError:
    """The 400 for apply_chat_template's RequestError: the field its message starts with is the param
    ("messages.1.tool_calls.0.function.arguments: ..."); a message naming none is about the messages."""
    match = _TEMPLATE_FIELD.match(message)
    if match is None:
        return invalid("messages", message)
    return ApiError(400, message, param=match.group(1))


# The request fields apply_chat_template's messages start with (then ":" or a space).
_TEMPLATE_FIELD = re.compile(r"(messages\.[\w.]+|chat_template_kwargs|continue_final_message)\b")


class Generation:
    """The outputs of one API request's engine requests, as they come (tag = prompt index)."""

    def __init__(self, engine_loop: EngineLoop):
        self.engine_loop = engine_loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.streams: list[RequestStream] = []
        self._num_finished = 0

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield (prompt index, RequestOutput) until every request finished."""
        num_unfinished = len(self.streams)
        while num_unfinished:
            index, item = await self.queue.get()
            if isinstance(item, EngineStopped):
                raise ApiError(503, f"the request was aborted: {item}")
            if isinstance(item, RequestFailed):
                raise ApiError(500, f"internal error: {item}")
            if isinstance(item, BaseException):
                raise ApiError(500, f"internal error: request {self.streams[index].request_id!r} failed: the engine "
                               f"failed: {type(item).__name__}: {item}")
            if item.finished:
                num_unfinished -= 1
            yield index, item

    async def final_outputs(self) -> list[RequestOutput]:
        """Every request's last output, in prompt order."""
        finals: dict[int, RequestOutput] = {}
        async for index, output in self:
            finals[index] = output
        return [finals[i] for i in range(len(self.streams))]

    def abort(self) -> None:
        """Abort what has not finished (a client went away); a no-op once all finished."""
        for stream in self.streams:
            if not stream.is_finished:
                self.engine_loop.abort(stream.request_id)
