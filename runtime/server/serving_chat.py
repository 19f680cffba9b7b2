"""POST /v1/chat/completions: messages rendered with the artifact's chat template, then generated
like a completion; streaming sends a role chunk per choice, content deltas, and a finish chunk.

With tools (vLLM's behaviour): they go to the template; tool_choice "auto" (the default with tools)
reads calls out of the output with the server's --tool-call-parser, a named function or "required"
constrain the output (protocol.ChatCompletionRequest.guided_decoding) and read it as calls. A reply's
message then has `tool_calls` [{id "chatcmpl-tool-...", type "function", function {name, arguments}}];
a stream sends each call's index, id, type and name in its first delta and its arguments in pieces
after (tool_parsers: the pieces joined are the non-streamed arguments); with parallel_tool_calls false
only the first call is returned (vLLM's). finish_reason is "tool_calls"
when "auto" or "required" gave calls and the output ended by itself; a named function keeps "stop" (OpenAI's
and vLLM's), and an output cut by max_tokens keeps "length".

With --reasoning-parser (reasoning_parsers): the thinking goes to `reasoning` / `reasoning_content`,
only the answer to `content` and to the tool parser; usage gains completion_tokens_details.reasoning_tokens.
gpt-oss's harmony output (--reasoning-parser openai_gptoss, --tool-call-parser openai) is read by one
parser (harmony.py), its markers kept in the text (skip_special_tokens off).
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator

from llmc.errors import RequestError
from llmc.runtime.multimodal import chat_images, has_image_parts
from llmc.runtime.outputs import CompletionOutput, RequestOutput
from llmc.runtime.sampling_params import SamplingParams
from llmc.runtime.server.errors import ApiError, as_api_error
from llmc.runtime.server.formatting import (SSE_DONE, DeltaTracker, chat_logprobs, prompt_logprobs, sse, usage,
                                            usage_body)
from llmc.runtime.server.protocol import ChatCompletionRequest, checked_tools
from llmc.runtime.server import reasoning_parsers as reasoning
from llmc.runtime.server.serving import EventStream, Generation, ServingContext, new_id, parse_generation_request, respond
from llmc.runtime.server.tool_parsers import ToolParser, fold, make_parser


async def create_chat_completion(ctx: ServingContext, body: object, arrival_time: float | None = None
                                 ) -> dict | EventStream:
    """The response body, or (stream=true) an iterator of SSE events."""
    request_id = new_id("chatcmpl")
    request, _, generation, num_prompt_tokens = await start_chat_generation(ctx, body, request_id, arrival_time)
    return await respond(generation, ChatReply(ctx, request, request_id, num_prompt_tokens), request.stream)


async def start_chat_generation(ctx: ServingContext, body: object, request_id: str, arrival_time: float | None = None
                                ) -> tuple[ChatCompletionRequest, SamplingParams, Generation, int]:
    """What a chat completion does before it answers (the Responses API's too, with its request as a chat
    body): the body checked, the messages rendered with the chat template (tools included), the prompt
    checked and queued. Returns (request, its SamplingParams, the Generation, the prompt's token count)."""
    request, params = parse_generation_request(ctx, ChatCompletionRequest, body)
    ctx.check_tool_choice(request.tool_mode)
    reasoning.check_request(ctx.reasoning_parser, request, ctx.reasoning_in_structured_output)
    if ctx.tool_call_parser in ("hermes", "mistral", "glm45", "glm47", "kimi_k2") and request.tool_mode in (
            "auto", "required", "named"):
        # vLLM's hermes, mistral, glm45, glm47 and kimi_k2 parsers (their adjust_request): <tool_call> and
        # </tool_call> are special tokens in some models' vocabularies, [TOOL_CALLS] and [ARGS] in Mistral's,
        # Kimi-K2's <|tool_call...|> markers in its, and skipped they would never reach the parser
        params = params.replace(skip_special_tokens=False)
    if ctx.reasoning_parser in ("openai_gptoss", "mistral"):
        # harmony's markers are special tokens (harmony.py), and so are Magistral's [THINK] and [/THINK]
        params = params.replace(skip_special_tokens=False)
    messages = request.template_messages()
    try:
        if has_image_parts(messages):  # a vision model's images and videos (runtime/multimodal.py); text models refuse
            ctx.engine_loop.engine.check_takes_images("messages")
        videos = ctx.engine_loop.engine.chat_videos()  # the parts decoded off the event loop (a video takes a while)
        messages, images, videos = await ctx.run_off_loop(chat_images, messages, videos)
    except RequestError as e:
        raise as_api_error(e) from None
    media = {**({"image": images} if images else {}), **({"video": videos} if videos else {})}
    token_ids = await ctx.render_chat_off_loop(messages, request.template_options())
    if params.truncate_prompt_tokens is not None:  # here, so that usage counts what the model sees
        token_ids = token_ids[-params.truncate_prompt_tokens:]
    ctx.check_prompt_length(token_ids, params, "messages", request.requested_max_tokens, request.max_tokens_param)
    try:
        generation = await ctx.generate([token_ids], params, request_id, request.priority, arrival_time,
                                         ctx.lora_request(request.model),
                                         media or None, cache_salt=request.cache_salt)
    except ApiError as e:
        raise _as_chat_error(e) from None
    return request, params, generation, generation.streams[0].num_prompt_tokens


def _as_chat_error(error: ApiError) -> ApiError:
    """The engine's error about SamplingParams.logprobs is about the chat API's top_logprobs."""
    if error.param != "logprobs":
        return error
    message = re.sub(r"^logprobs\b", "top_logprobs", error.message)
    return ApiError(error.status_code, message, param="top_logprobs", code=error.code, headers=error.headers)


class ChatReply:
    """A chat completion's reply (whole, or streamed); the Responses API reads outputs with its `new_parser`."""

    def __init__(self, ctx: ServingContext, request: ChatCompletionRequest, request_id: str, num_prompt_tokens: int):
        self.ctx = ctx
        self.request = request
        self.num_prompt_tokens = num_prompt_tokens
        self.request_id = request_id
        self.created = int(time.time())
        self.tool_mode = request.tool_mode
        self._parsers: dict[int, ToolParser | None] = {}  # a stream's, per choice

    def new_parser(self) -> ToolParser | reasoning.WithReasoning | None:
        """The reader of one choice's text (its reasoning, with --reasoning-parser), or None when it is all content."""
        return reasoning.with_reasoning(self.ctx.reasoning_parser, self.request, self._tool_parser())

    def _tool_parser(self) -> ToolParser | None:
        """The reader of tool calls in one choice's text, or None when its text is all content."""
        if self.tool_mode == "auto":
            return make_parser(self.ctx.tool_call_parser, tools=checked_tools(self.request.tools))
        if self.tool_mode == "required":
            return make_parser("required")
        if self.tool_mode == "named":
            return make_parser("named", self.request.named_tool[1]["name"])
        return None

    def _finish_reason(self, completion: CompletionOutput, parser: ToolParser | None) -> str | None:
        """vLLM's (and OpenAI's): "tool_calls" when calls were read out of an output that ended by itself
        ("stop"), with tool_choice "auto" or "required"; a named function keeps "stop", and a cut output
        keeps "length" (a call cut by max_tokens must not look complete)."""
        if (completion.finish_reason == "stop" and parser is not None and self.tool_mode in ("auto", "required")
                and parser.called):
            return "tool_calls"
        return completion.finish_reason

    def _message(self, completion: CompletionOutput) -> tuple[dict, str | None]:
        """A whole choice's message and finish_reason."""
        parser = self.new_parser()
        if parser is None:
            return ({"role": "assistant", "content": completion.text, **reasoning.fields(self.ctx.reasoning_parser, None)},
                    completion.finish_reason)
        thought, events = reasoning.reasoning_of(parser.feed(completion.text) + parser.finish())
        content, calls = fold(events)
        if self.request.parallel_tool_calls is False:
            calls = calls[:1]
        if self.tool_mode in ("required", "named"):
            content = ""  # vLLM's message of a forced call
        elif (calls or reasoning.thinks(self.ctx.reasoning_parser, self.request.chat_template_kwargs)) and not content:
            content = None
        message = {"role": "assistant", "content": content, **reasoning.fields(self.ctx.reasoning_parser, thought)}
        if calls:
            ids = {event[1]: event[3] for event in events if event[0] == "call" and len(event) > 3}
            message["tool_calls"] = [{"id": ids.get(index) or new_id("chatcmpl-tool"), "type": "function",
                                      "function": {"name": name, "arguments": arguments}}
                                     for index, (name, arguments) in enumerate(calls)]
        return message, self._finish_reason(completion, parser)

    def _header(self, obj: str) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.ctx.response_model(self.request.model)}

    def _logprobs(self, token_ids: list[int], logprobs: list | None) -> dict | None:
        if not self.request.logprobs:
            return None
        return chat_logprobs(self.ctx.tokenizer, token_ids, logprobs or [], self.request.top_logprobs or 0)

    def response(self, outputs: list[RequestOutput]) -> dict:
        (output,) = outputs  # one conversation per chat request
        choices = []
        for c in output.outputs:
            message, finish_reason = self._message(c)
            choices.append({"index": c.index, "message": message, "logprobs": self._logprobs(c.token_ids, c.logprobs),
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason,
                            **({"token_ids": list(c.token_ids)} if self.request.return_token_ids else {})})
        body = {**self._header("chat.completion"), "choices": choices, "usage": self._usage(output)}
        if self.request.return_token_ids:  # vLLM's: the prompt's on the response, the generated ones on each choice
            body["prompt_token_ids"] = output.prompt_token_ids
        if self.request.prompt_logprobs is not None:  # vLLM: on the response, not on a choice
            body["prompt_logprobs"] = prompt_logprobs(self.ctx.tokenizer, output, self.request.prompt_logprobs)
        return body

    async def stream(self, generation: Generation) -> AsyncIterator[str]:
        tracker = DeltaTracker()
        final: RequestOutput | None = None
        try:
            for index in range(self.request.n):
                yield self._chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None}, self._running_usage(None, 0))
            prompt_ids_sent = False  # return_token_ids: the prompt's in the first chunk of the engine's output (vLLM's)
            async for _, output in generation:
                final = output
                for completion in output.outputs:
                    choice = self._choice_delta(completion, tracker)
                    if choice is not None:
                        prompt_ids = None if prompt_ids_sent else output.prompt_token_ids
                        prompt_ids_sent = True
                        yield self._chunk(choice, self._running_usage(output, len(completion.token_ids)), prompt_ids)
            if self.request.include_usage and final is not None:
                yield sse({**self._header("chat.completion.chunk"), "choices": [], "usage": self._usage(final)})
        except ApiError as e:
            yield sse(e.body())
        finally:
            generation.abort()
        yield SSE_DONE

    def _usage(self, output: RequestOutput) -> dict:
        """The usage of the whole request (with --reasoning-parser, vLLM's completion_tokens_details.reasoning_tokens)."""
        return reasoning.with_reasoning_tokens(usage([output]), self.ctx, self.request, output)

    def _running_usage(self, output: RequestOutput | None, num_completion: int) -> dict | None:
        """With stream_options.continuous_usage_stats, the usage so far (vLLM: this choice's tokens)."""
        if not self.request.continuous_usage:
            return None
        if output is None:  # the role chunks, before the engine answered
            return usage_body(self.num_prompt_tokens, 0, 0)
        return usage_body(len(output.prompt_token_ids), num_completion, output.num_cached_tokens)

    def _chunk(self, choice: dict, running_usage: dict | None, prompt_token_ids: list[int] | None = None) -> str:
        chunk = {**self._header("chat.completion.chunk"), "choices": [choice]}
        if self.request.return_token_ids:
            chunk["prompt_token_ids"] = prompt_token_ids
        if self.request.include_usage:
            chunk["usage"] = running_usage  # None unless continuous: only the final chunk carries usage
        return sse(chunk)

    def _choice_delta(self, completion: CompletionOutput, tracker: DeltaTracker) -> dict | None:
        key = (0, completion.index)
        if tracker.was_finished(key):
            return None
        delta_text, new = tracker.delta(key, completion.text, completion.token_ids)
        new_ids = completion.token_ids[new]
        finish_reason = completion.finish_reason
        if completion.index not in self._parsers:
            self._parsers[completion.index] = self.new_parser()
        parser = self._parsers[completion.index]
        if parser is None:
            delta, has_news = {"content": delta_text}, bool(delta_text)
        else:  # what the parser can tell of the new text: content, and pieces of calls
            events = parser.feed(delta_text) + (parser.finish() if completion.is_finished else [])
            delta = {**reasoning.delta_fields(self.ctx.reasoning_parser, events), **self._tool_delta(events)}
            finish_reason, has_news = self._finish_reason(completion, parser), bool(delta)
        if not tracker.finish(key, completion.is_finished) and not has_news and not (self.request.logprobs and new_ids):
            return None
        choice = {"index": completion.index, "delta": delta,
                  "logprobs": self._logprobs(new_ids, (completion.logprobs or [])[new]),
                  "finish_reason": finish_reason,
                  **({"token_ids": list(new_ids)} if self.request.return_token_ids else {})}
        if completion.is_finished:
            choice["stop_reason"] = completion.stop_reason
        return choice

    def _tool_delta(self, events: list) -> dict:
        """A stream's delta of one choice from its parser's events: content joined, and per call touched
        an entry (the first of a call: index, id, type, name and the arguments so far; later ones:
        index and the next arguments)."""
        content = "".join(event[1] for event in events if event[0] == "content")
        if self.request.parallel_tool_calls is False:  # the first call only
            events = [event for event in events if event[0] == "content" or event[1] == 0]
        calls: dict[int, dict] = {}
        for event in events:
            if event[0] == "call":  # the model's own id where the parser read one (kimi_k2's)
                call_id = event[3] if len(event) > 3 else new_id("chatcmpl-tool")
                calls[event[1]] = {"index": event[1], "id": call_id, "type": "function",
                                   "function": {"name": event[2], "arguments": ""}}
            elif event[0] == "args":
                entry = calls.setdefault(event[1], {"index": event[1], "function": {"arguments": ""}})
                entry["function"]["arguments"] += event[2]
        delta: dict = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = list(calls.values())
        return delta
