"""POST /v1/responses: OpenAI's Responses API, served as vLLM serves it, on the chat path.

A request (protocol.ResponsesRequest) becomes a chat completion request: `instructions` a first system
message, `input` (a string, or message / function_call / function_call_output / reasoning items) the
chat messages, function tools in chat's shape, text.format a response_format, max_output_tokens
max_tokens. serving_chat.start_chat_generation renders and queues it, so the chat template, sampling,
tool choice, structured output, reasoning checks and the prefix cache are the chat path's. The output
is read with the chat reply's parser (reasoning_parsers, tool_parsers) into output items, in the
order the model wrote them: a `reasoning` item (with --reasoning-parser), a `message` with one
`output_text` part, `function_call` items. A stream sends OpenAI's events with sequence numbers; the
non-streamed response is built by the same builder from the same events, so both give one Response.

Stored responses (`store`, `previous_response_id`, GET /v1/responses/{id}, its input_items, DELETE):
vLLM keeps them in memory only when enabled (VLLM_ENABLE_RESPONSES_API_STORE); llmc's
`--enable-responses-store` (or that variable) keeps the last MAX_STORED_RESPONSES in memory. Without
it `store: true` is accepted and not kept (the response says `store: false`), as vLLM does, and a
previous_response_id is a 404. A kept response is in the store from the moment it is queued (status
in_progress, its output as far as generated), so GET sees it while it is generated.

`background: true` (needs the store, as vLLM's): the POST returns at once the queued Response; a task
of the event loop generates it, and GET returns its state; POST /v1/responses/{id}/cancel aborts its
engine request (its KV blocks freed) and leaves it `cancelled`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable

from llmc.runtime.outputs import CompletionOutput, RequestOutput
from llmc.runtime.server import reasoning_parsers as reasoning
from llmc.runtime.server.errors import ApiError, invalid
from llmc.runtime.server.formatting import DeltaTracker
from llmc.runtime.server.protocol import INCLUDE_LOGPROBS, ResponsesRequest, responses_error
from llmc.runtime.server.serving import EventStream, Generation, ServingContext, parse_body, respond
from llmc.runtime.server.serving_chat import ChatReply, start_chat_generation

logger = logging.getLogger("llmc")

# The responses a store keeps (the oldest go first).
MAX_STORED_RESPONSES = 1024
# A Response's statuses while it is generated; the others are final.
UNFINISHED = ("queued", "in_progress")
# GET /v1/responses/{id}/input_items: its `limit` (OpenAI's range and default).
MAX_LIST_LIMIT, DEFAULT_LIST_LIMIT = 100, 20
# OpenAI's `include` values (the SDK's ResponseIncludable): input items as this server keeps them have none of
# the content they add (images, built-in tool results, encrypted reasoning, output logprobs).
INCLUDABLE = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
              "message.input_image.image_url", "computer_call_output.output.image_url",
              "code_interpreter_call.outputs", "reasoning.encrypted_content", INCLUDE_LOGPROBS)


def response_id(prefix: str) -> str:
    """OpenAI's ids: resp_..., msg_..., fc_..., call_..., rs_..."""
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclasses.dataclass
class StoredResponse:
    """A kept response: its body (while it is generated, a snapshot: status queued or in_progress, the output
    so far), the conversation that led to it (its input items after those of the responses before it; not
    their instructions, which OpenAI does not carry over), its input items as listed (ids assigned), and for a
    background response being generated, the task generating it and its Generation (what cancel aborts).
    While it is generated, `output_so_far` gives its output items as they stand (read when asked for, not
    copied at every step; a message's logprobs every generated token's, as in the finished response)."""

    response: dict
    conversation: list[dict]
    input_items: list[dict] = dataclasses.field(default_factory=list)
    task: asyncio.Task | None = None
    generation: Generation | None = None
    output_so_far: Callable[[], list[dict]] | None = None

    @property
    def is_finished(self) -> bool:
        return self.response["status"] not in UNFINISHED

    def current(self) -> dict:
        """The response as it stands (a new dict): while it is generated, with its output so far."""
        if self.output_so_far is not None and not self.is_finished:
            return self.response | {"output": self.output_so_far()}
        return dict(self.response)

    def end(self, status: str, **fields) -> None:
        """Left unfinished (cancelled, failed): its output as far as generated, an item still being written
        `incomplete`."""
        output = [item | {"status": "incomplete"} if item.get("status") == "in_progress" else item
                  for item in self.current()["output"]]
        self.response = self.response | {"status": status, "output": output, **fields}
        self.output_so_far = None

    def stop(self) -> None:
        """Abort the generation (its engine request and KV blocks) and its task, if they still run."""
        if self.generation is not None:
            self.generation.abort()
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def cancel(self) -> None:
        """A background response cancelled: status `cancelled`, its output as far as generated (an item
        still being written `incomplete`), its generation aborted."""
        if self.is_finished:
            return
        self.end("cancelled")
        self.stop()


class ResponseStore:
    """The responses kept for GET /v1/responses/{id} (and its input_items), cancel and previous_response_id,
    in memory, the last `capacity` of them. Past capacity the oldest finished response is dropped (one still
    generated only when none is finished). One dropped (so, or deleted) while a background task still
    generates it has its generation aborted: nobody could read it."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES):
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: dict, conversation: list[dict], input_items: list[dict] | None = None) -> StoredResponse:
        record = StoredResponse(response, conversation, list(input_items or []))
        self.add(record)
        return record

    def add(self, record: StoredResponse) -> None:
        rid = record.response["id"]
        previous = self._responses.get(rid)
        if previous is not None and previous is not record:
            previous.stop()
        self._responses[rid] = record
        self._responses.move_to_end(rid)
        while len(self._responses) > self.capacity:
            oldest = next((key for key, kept in self._responses.items() if kept.is_finished), None)
            dropped = self._responses.pop(oldest if oldest is not None else next(iter(self._responses)))
            dropped.stop()

    def get(self, response_id: str) -> StoredResponse | None:
        return self._responses.get(response_id)

    def delete(self, response_id: str) -> bool:
        record = self._responses.pop(response_id, None)
        if record is None:
            return False
        record.stop()
        return True

    def discard(self, record: StoredResponse) -> None:
        """Drop this record (not another one under its id)."""
        rid = record.response["id"]
        if self._responses.get(rid) is record:
            del self._responses[rid]

    def stop_all(self) -> None:
        """Abort every background generation still running (the server stops)."""
        for record in self._responses.values():
            record.stop()

    def __len__(self) -> int:
        return len(self._responses)


def not_found(response_id: str, param: str, store: ResponseStore | None) -> ApiError:
    why = "" if store is not None else (" (this server keeps no responses: start it with --enable-responses-store "
                                        "to keep them)")
    code = "previous_response_not_found" if param == "previous_response_id" else None
    return ApiError(404, f"Response with id {response_id!r} not found{why}.", param=param, code=code)


async def create_response(ctx: ServingContext, body: object, arrival_time: float | None = None
                          ) -> dict | EventStream:
    """The Response, or (stream=true) an iterator of its SSE events; kept in ctx.response_store if there is
    one. A background request returns the queued Response at once; a task of the event loop generates it."""
    store = ctx.response_store
    request = parse_body(ResponsesRequest, body)
    request.check()
    if request.background:
        _check_background(request, store)
    history: list[dict] = []
    if request.previous_response_id is not None:
        found = store.get(request.previous_response_id) if store is not None else None
        if found is None:
            raise not_found(request.previous_response_id, "previous_response_id", store)
        if not found.is_finished:
            raise invalid("previous_response_id", f"response {request.previous_response_id!r} is still "
                          f"{found.response['status']}: continue from it once it is done (GET it until then)")
        history = found.conversation + [item for item in found.response["output"] if not _cut_call(item)]
    rid = response_id("resp")
    input_items = request.input_items()
    try:
        chat_request, params, generation, num_prompt_tokens = await start_chat_generation(
            ctx, request.chat_body(history, request.stream), rid, arrival_time)
    except ApiError as e:
        raise responses_error(e) from None
    kept = store if request.store else None
    reply = _ResponsesReply(ctx, request, ChatReply(ctx, chat_request, rid, num_prompt_tokens), params, kept)
    if kept is not None:  # visible to GET from now on
        snapshot = reply._body("queued" if request.background else "in_progress", [], None)
        reply.record = kept.put(snapshot, history + input_items, listed_input_items(input_items))
    if request.background:
        record = reply.record
        record.generation = generation
        record.task = asyncio.get_running_loop().create_task(reply.generate_in_background(generation),
                                                             name=f"llmc-background-{rid}")
        return dict(record.response)
    if request.stream:
        def close() -> None:
            generation.abort()
            reply.abandon()

        return EventStream(reply.stream(generation), close)
    try:
        return await respond(generation, reply, False)
    except BaseException:
        reply.abandon()
        raise


def _check_background(request: ResponsesRequest, store: ResponseStore | None) -> None:
    """400s for a background request this server cannot run (vLLM's: only with the store; not unstored)."""
    if store is None:
        raise invalid("background", "needs the response store, which this server does not keep (a background "
                      "response is only read through it): start it with --enable-responses-store (or "
                      "VLLM_ENABLE_RESPONSES_API_STORE=1), or leave background out")
    if not request.store:
        raise invalid("background", "needs store: true (a background response is only read through the store); "
                      "leave store at true or background out")
    if request.stream:
        raise invalid("stream", "streaming a background response is not supported by this server: send "
                      "background: true without stream and GET /v1/responses/{id} until it is done")


def _checked_store(store: ResponseStore | None, response_id: str) -> StoredResponse:
    found = store.get(response_id) if store is not None else None
    if found is None:
        raise not_found(response_id, "response_id", store)
    return found


def retrieve_response(ctx: ServingContext, response_id: str, query: dict[str, str]) -> dict:
    """GET /v1/responses/{id}: the kept response, finished or being generated (status queued/in_progress).
    OpenAI's streamed retrieve (`stream`, `starting_after`, `include_obfuscation`) and `include` are refused."""
    for name in ("stream", "starting_after", "include_obfuscation"):
        if name in query and not (name != "starting_after" and query[name].lower() == "false"):
            raise invalid(name, "streaming a kept response again is not supported by this server: GET it without "
                          f"{name} (the whole response, as far as it is generated)")
    if "include" in query or "include[]" in query:
        raise invalid("include", "is not supported when retrieving a response: it carries what the creating "
                      "request's include asked for (message.output_text.logprobs)")
    return _checked_store(ctx.response_store, response_id).current()


def cancel_response(ctx: ServingContext, response_id: str) -> dict:
    """POST /v1/responses/{id}/cancel: a background response being generated is aborted (its engine request
    and KV blocks freed) and left `cancelled`; a finished one is returned unchanged; a response that was not
    created in the background is a 400 (OpenAI's rule)."""
    record = _checked_store(ctx.response_store, response_id)
    if not record.response["background"]:
        raise invalid("response_id", "Only background responses can be cancelled; this one was created without "
                      "background: true")
    record.cancel()
    return record.current()


def list_input_items(ctx: ServingContext, response_id: str, query: list[tuple[str, str]]) -> dict:
    """GET /v1/responses/{id}/input_items: OpenAI's list of the response's input items (as sent, ids assigned),
    `order` desc (default) or asc, `limit` 1-100 (20), `after` / `before` an item id (the page after or before
    it in that order), `include` (accepted: these items have none of what its values add)."""
    record = _checked_store(ctx.response_store, response_id)
    known = ("after", "before", "limit", "order", "include", "include[]")
    params: dict[str, str] = {}
    for name, value in query:
        if name not in known:
            raise invalid(name, f"is not a parameter of this list (it takes {', '.join(known[:5])})")
        if name.startswith("include"):
            if value not in INCLUDABLE:
                raise invalid("include", f"{value!r} is not one of OpenAI's include values ({', '.join(INCLUDABLE)})")
        elif name in params:
            raise invalid(name, "is given more than once")
        else:
            params[name] = value
    order = params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("order", f'must be "asc" or "desc", got {order!r}')
    try:
        limit = int(params.get("limit", DEFAULT_LIST_LIMIT))
    except ValueError:
        raise invalid("limit", f"must be an integer from 1 to {MAX_LIST_LIMIT}, got {params['limit']!r}") from None
    if not 1 <= limit <= MAX_LIST_LIMIT:
        raise invalid("limit", f"must be from 1 to {MAX_LIST_LIMIT}, got {limit}")
    if "after" in params and "before" in params:
        raise invalid("before", "cannot be given with after: page one way at a time")
    items = record.input_items if order == "asc" else record.input_items[::-1]
    ids = [item["id"] for item in items]
    if "after" in params or "before" in params:
        name = "after" if "after" in params else "before"
        if params[name] not in ids:
            raise invalid(name, f"{params[name]!r} is not the id of an input item of response {response_id!r}")
        at = ids.index(params[name])
        if name == "after":
            data, has_more = items[at + 1:at + 1 + limit], at + 1 + limit < len(items)
        else:
            data, has_more = items[max(0, at - limit):at], at - limit > 0
    else:
        data, has_more = items[:limit], limit < len(items)
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


def listed_input_items(items: list[dict]) -> list[dict]:
    """Checked input items as OpenAI lists them (the SDK's ResponseItem): each with an id (its own, else
    one assigned: msg_, fc_, fco_, rs_) and a status; a message's content as parts (input_text, or an
    assistant's output_text with annotations)."""
    listed = []
    for item in items:
        kind = item["type"]
        item = dict(item)
        if kind == "message":
            assistant = item["role"] == "assistant"
            content = item["content"]
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            item["content"] = [_listed_part(part, assistant) for part in parts]
            prefix = "msg"
        else:
            prefix = {"function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}[kind]
        if kind == "reasoning":
            item.setdefault("summary", [])
        else:
            item.setdefault("status", "completed")
        if not (isinstance(item.get("id"), str) and item["id"]):
            item["id"] = response_id(prefix)
        listed.append(item)
    return listed


def _listed_part(part: dict, assistant: bool) -> dict:
    if part.get("type") not in ("text", "input_text", "output_text"):
        return part  # a refusal
    if assistant:
        return {"annotations": [], **part, "type": "output_text", "text": part.get("text") or ""}
    return {**part, "type": "input_text", "text": part.get("text") or ""}


class _OutputBuilder:
    """A Response's output items, built from one sequence's parser events as they come, and the stream
    events that build them on the client (OpenAI's order: output_item.added, content_part.added, deltas,
    the done events). The logprobs of the generated tokens go on the message's output_text."""

    def __init__(self, with_logprobs: bool):
        self.items: list[dict] = []
        self.events: list[dict] = []  # not sent yet
        self.with_logprobs = with_logprobs
        self.logprobs: list[dict] = []  # every token's
        self._pending_logprobs: list[dict] = []  # not yet on a text delta
        self._open: dict | None = None
        self._calls: dict[int, dict] = {}  # the parser's call index -> its item
        self.reasoning_text = ""

    def add_logprobs(self, entries: list[dict]) -> None:
        self.logprobs += entries
        self._pending_logprobs += entries

    def feed(self, events: list[tuple]) -> None:
        for event in events:
            kind = event[0]
            if kind == "reasoning" and event[1]:
                item = self._item("reasoning")
                item["content"][0]["text"] += event[1]
                self.reasoning_text += event[1]
                self._emit("response.reasoning_text.delta", item, content_index=0, delta=event[1])
            elif kind == "content" and event[1]:
                item = self._item("message")
                item["content"][0]["text"] += event[1]
                logprobs, self._pending_logprobs = self._pending_logprobs, []
                self._emit("response.output_text.delta", item, content_index=0, delta=event[1],
                           logprobs=[_delta_logprob(entry) for entry in logprobs])
            elif kind == "call":
                self._close()
                item = {"id": response_id("fc"), "type": "function_call", "status": "in_progress",
                        "call_id": response_id("call"), "name": event[2], "arguments": ""}
                self._calls[event[1]] = item
                self._add(item)
            elif kind == "args" and event[2]:
                item = self._calls[event[1]]
                item["arguments"] += event[2]
                self._emit("response.function_call_arguments.delta", item, delta=event[2])

    def snapshot(self) -> list[dict]:
        """The output items as they stand (copies), a message's logprobs every token's so far (as `finish` gives them)."""
        items = [_copy(item) for item in self.items]
        if self.with_logprobs:
            for item in items:
                if item["type"] == "message":
                    item["content"][0]["logprobs"] = list(self.logprobs)
        return items

    def finish(self, status: str) -> None:
        """The end of the output: the open item done (`status`: "completed", or "incomplete" when cut); a
        message's logprobs are every generated token's, also those after it closed (a call's, streamed)."""
        self._close(status)
        if self.with_logprobs:
            for item in self.items:
                if item["type"] == "message":
                    item["content"][0]["logprobs"] = list(self.logprobs)

    def _item(self, kind: str) -> dict:
        """The open item of this kind, a new one if another is open (which is closed first)."""
        if self._open is not None and self._open["type"] == kind:
            return self._open
        self._close()
        if kind == "message":
            item = {"id": response_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": []}
            if self.with_logprobs:
                part["logprobs"] = []
        else:
            item = {"id": response_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self._add(item)
        item["content"].append(part)
        self._emit("response.content_part.added", item, content_index=0, part=dict(part))
        return item

    def _add(self, item: dict) -> None:
        self.items.append(item)
        self._open = item
        self._emit("response.output_item.added", None, item=_copy(item))

    def _close(self, status: str = "completed") -> None:
        item, self._open = self._open, None
        if item is None:
            return
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            if self.with_logprobs:
                part["logprobs"] = list(self.logprobs)
            self._emit("response.output_text.done", item, content_index=0, text=part["text"],
                       logprobs=[_delta_logprob(entry) for entry in self.logprobs] if self.with_logprobs else [])
            self._emit("response.content_part.done", item, content_index=0, part=_copy(part))
        elif item["type"] == "reasoning":
            part = item["content"][0]
            self._emit("response.reasoning_text.done", item, content_index=0, text=part["text"])
            self._emit("response.content_part.done", item, content_index=0, part=_copy(part))
        else:
            self._emit("response.function_call_arguments.done", item, name=item["name"], arguments=item["arguments"])
        self._emit("response.output_item.done", None, output_index=self.items.index(item), item=_copy(item))

    def _emit(self, kind: str, of: dict | None, **fields) -> None:
        event = {"type": kind}
        if of is not None:  # an event about an item's content
            event |= {"item_id": of["id"], "output_index": self.items.index(of)}
        elif "output_index" not in fields:
            event["output_index"] = len(self.items) - 1
        self.events.append(event | fields)

    def take_events(self) -> list[dict]:
        events, self.events = self.events, []
        return events


def _copy(item: dict) -> dict:
    return {key: ([dict(p) for p in value] if key == "content" else value) for key, value in item.items()}


def _delta_logprob(entry: dict) -> dict:
    """A text event's logprob (token, logprob, top_logprobs), from the output_text's entry (which adds bytes)."""
    return {"token": entry["token"], "logprob": entry["logprob"],
            "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in entry["top_logprobs"]]}


class _ResponsesReply:
    def __init__(self, ctx: ServingContext, request: ResponsesRequest, chat: ChatReply, params,
                 store: ResponseStore | None):
        self.ctx = ctx
        self.request = request
        self.chat = chat
        self.params = params
        self.store = store
        self.record: StoredResponse | None = None  # kept: in the store from the start
        self.created_at = int(time.time())

    def _new_builder(self):
        parser = self.chat.new_parser()
        return _OutputBuilder(self.request.wants_logprobs), parser

    def _events(self, parser, text: str, finished: bool) -> list[tuple]:
        """The parser's events for the next piece of text; a forced tool choice's output is only calls."""
        if parser is None:
            return [("content", text)]
        events = parser.feed(text) + (parser.finish() if finished else [])
        if self.chat.tool_mode in ("required", "named"):  # vLLM's: no content beside a forced call
            events = [event for event in events if event[0] != "content"]
        if self.request.parallel_tool_calls is False:  # the first call only (vLLM's)
            events = [event for event in events if event[0] not in ("call", "args") or event[1] == 0]
        return events

    def _logprob_entries(self, token_ids: list[int], logprobs: list | None) -> list[dict]:
        body = self.chat._logprobs(token_ids, logprobs)
        return body["content"] if body is not None else []

    def response(self, outputs: list[RequestOutput]) -> dict:
        (output,) = outputs
        (completion,) = output.outputs
        builder, parser = self._new_builder()
        builder.add_logprobs(self._logprob_entries(completion.token_ids, completion.logprobs))
        builder.feed(self._events(parser, completion.text, True))
        return self._finished(builder, output, completion)

    def _finished(self, builder: _OutputBuilder, output: RequestOutput, completion: CompletionOutput) -> dict:
        """The open item closed and the final Response (completed, or incomplete when the output was cut)."""
        status = _status(completion)
        builder.finish(status)
        body = self._body(status, builder.items, self._usage(output, completion, builder.reasoning_text))
        body["completed_at"] = int(time.time()) if status == "completed" else None
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        record = self.record
        if record is not None and not record.is_finished:  # not once cancelled
            record.response, record.output_so_far = body, None
        return body

    def _progress(self, builder: _OutputBuilder) -> None:
        """The kept response being generated: in_progress, its output items so far (read from the builder)."""
        record = self.record
        if record is not None and not record.is_finished and record.output_so_far is None:
            record.response = record.response | {"status": "in_progress"}
            record.output_so_far = builder.snapshot

    def abandon(self) -> None:
        """A response that was not generated to its end (its client went away, the engine failed): a
        kept snapshot is dropped, as the response was never given (not a background one: see _fail)."""
        record = self.record
        if record is not None and not record.is_finished and self.store is not None:
            self.store.discard(record)

    def _fail(self, error: ApiError) -> None:
        record = self.record
        if record is not None and not record.is_finished:
            record.end("failed", error={"code": "server_error", "message": error.message})

    def _advance(self, builder: _OutputBuilder, parser, tracker: DeltaTracker, output: RequestOutput) -> dict | None:
        """One engine output into the builder (its events taken by the caller); the final Response when it is the last."""
        (completion,) = output.outputs
        text, new = tracker.delta((0, 0), completion.text, completion.token_ids)
        builder.add_logprobs(self._logprob_entries(completion.token_ids[new], (completion.logprobs or [])[new]))
        builder.feed(self._events(parser, text, completion.is_finished))
        if not completion.is_finished:
            self._progress(builder)
            return None
        return self._finished(builder, output, completion)

    async def generate_in_background(self, generation: Generation) -> None:
        """A background response's task: the kept snapshot follows the generation; at its end the final
        Response, or `failed` with the error; cancelled (StoredResponse.cancel), it stops at once."""
        builder, parser = self._new_builder()
        tracker = DeltaTracker()
        try:
            async for _, output in generation:
                final = self._advance(builder, parser, tracker, output)
                builder.take_events()
                if final is not None:
                    break
        except ApiError as e:
            self._fail(e)
        except Exception as e:  # noqa: BLE001 - kept as the response's error, and logged
            logger.exception("background response %s failed", self.chat.request_id)
            self._fail(ApiError(500, f"internal error: {type(e).__name__}: {e}"))
        finally:
            generation.abort()
            if self.record is not None:
                self.record.task = self.record.generation = None

    def _body(self, status: str, output: list[dict], usage: dict | None) -> dict:
        request = self.request
        return {
            "id": self.chat.request_id, "object": "response", "created_at": self.created_at, "status": status,
            "background": request.background, "error": None, "incomplete_details": None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "max_tool_calls": None, "metadata": request.metadata, "model": self.ctx.response_model(request.model),
            "output": output, "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": request.previous_response_id, "reasoning": request.reasoning,
            "service_tier": request.service_tier or "auto", "store": self.store is not None,
            "temperature": self.params.temperature, "text": request.text or {"format": {"type": "text"}},
            "tool_choice": request.tool_choice, "tools": request.echoed_tools(),
            "top_logprobs": request.top_logprobs, "top_p": self.params.top_p, "truncation": "disabled",
            "usage": usage, "user": request.user,
        }

    def _usage(self, output: RequestOutput, completion: CompletionOutput, reasoning_text: str) -> dict:
        num_input, num_output = len(output.prompt_token_ids), len(completion.token_ids)
        return {"input_tokens": num_input,
                "input_tokens_details": {"cached_tokens": output.num_cached_tokens, "cache_write_tokens": 0},
                "output_tokens": num_output,
                "output_tokens_details": {"reasoning_tokens": reasoning.count_tokens(self.ctx.tokenizer, reasoning_text)},
                "total_tokens": num_input + num_output}

    async def stream(self, generation: Generation) -> AsyncIterator[str]:
        sequence = 0

        def event(payload: dict) -> str:
            nonlocal sequence
            payload = payload | {"sequence_number": sequence}
            sequence += 1
            return _sse(payload)

        builder, parser = self._new_builder()
        tracker = DeltaTracker()
        try:
            snapshot = self._body("in_progress", [], None)
            yield event({"type": "response.created", "response": snapshot})
            yield event({"type": "response.in_progress", "response": snapshot})
            async for _, output in generation:
                final = self._advance(builder, parser, tracker, output)
                for payload in builder.take_events():
                    yield event(payload)
                if final is not None:
                    kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
                    yield event({"type": kind, "response": final})
                    break
        except ApiError as e:
            yield event({"type": "error", "code": e.code, "message": e.message, "param": e.param})
        finally:
            generation.abort()
            self.abandon()


def _cut_call(item: dict) -> bool:
    """A function_call that max_output_tokens cut before its arguments were whole JSON: not a call anyone
    could run or answer, and not one the chat template can render (it reads the arguments as JSON), so a
    previous_response_id leaves it out of the conversation."""
    if item["type"] != "function_call" or item["status"] != "incomplete":
        return False
    try:
        json.loads(item["arguments"] or "{}")
    except ValueError:
        return True
    return False


def _status(completion: CompletionOutput) -> str:
    return "incomplete" if completion.finish_reason == "length" else "completed"


def _sse(payload: dict) -> str:
    """An SSE event as OpenAI sends the Responses API's: the event's type, then its JSON."""
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"
