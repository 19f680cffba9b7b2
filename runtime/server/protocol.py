"""Request bodies of the OpenAI-compatible API (pydantic), and how they become `SamplingParams`.

Field names and defaults are OpenAI's, plus vLLM's extra sampling fields (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, priority, stop_token_ids, prompt_logprobs, ...) and
vLLM's limits (seed and priority in int64, at most MAX_LOGPROBS logprobs). Fields OpenAI or vLLM
have that would change the output and llmc does not implement (suffix, early_stopping,
guided_whitespace_pattern, ...) are refused with a 400 that lists them; any other unknown
field is kept in `model_extra` and named in a warning. Structured output (`response_format`
json_object / json_schema, vLLM's guided_json / guided_regex / guided_choice / guided_grammar /
guided_json_object / structured_outputs) becomes `SamplingParams.guided_decoding`; a schema or
grammar xgrammar cannot compile is a 400 naming the field it came from. Tools (vLLM's rules): `tools`
go to the chat template; tool_choice is "auto" when tools are given without it, a named function or
"required" is structured output (the function's parameters; vLLM's array of {name, parameters}),
which no other output constraint may join; a malformed tool or choice is a 400 naming its field.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmc.errors import RequestError
from llmc.runtime.multimodal import CHAT_IMAGE_PARTS, CHAT_VIDEO_PART
from llmc.runtime.pooling import REQUEST_TASKS
from llmc.runtime.sampling_params import MAX_ABS_LOGIT_BIAS, SamplingParams
from llmc.runtime.server.errors import ApiError, invalid
from llmc.runtime.structured_output import GuidedDecodingParams
from llmc.runtime.tokenizer import checked_tools as tokenizer_checked_tools, text_of_parts

# The most logprobs per token a request may ask for before the engine is up (then its max_logprobs option;
# vLLM's default).
MAX_LOGPROBS = 20
# vLLM's range for seed and priority (a C int64).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
EMPTY_PROMPT_MESSAGE = "Either prompt or prompt_embeds must be provided and non-empty."

# Per-request caps (a 400 naming the field beyond them): one request must not hold the engine.
MAX_N = 128  # n and best_of: sequences generated for one prompt
MAX_PROMPTS = 256  # prompts in one completions request
MAX_STOP_STRINGS = 64  # entries of `stop`
MAX_STOP_STRING_CHARS = 1024  # characters of one stop string
MAX_LOGIT_BIAS_ENTRIES = 1024  # tokens in `logit_bias`
MAX_TOKEN_ID_LIST = 65536  # entries of stop_token_ids / allowed_token_ids

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]

# Fields of OpenAI's or vLLM's API that change what is generated and that llmc does not implement,
# with the values that are harmless (the default): a request that sets any other value gets a 400.
_UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "early_stopping": (False, None),
    "guided_decoding_backend": (None, "xgrammar", "auto"),
    "guided_whitespace_pattern": (None,), "logprob_token_ids": (None,),
    "truncation_side": (None, "left"), "return_tokens_as_token_ids": (None, False),
    "watermarking": (None, False), "thinking_token_budget": (None,), "repetition_detection": (None,),
    "documents": (None,),
    "mm_processor_kwargs": (None, {}),  # vLLM's per-request processor settings (a video's fps, frame counts)
    "functions": (None, []), "function_call": (None, "none"), "prediction": (None,), "audio": (None,),
    "modalities": (None, ["text"]), "logits_processors": (None,),
    "echo": (None, False),  # on chat completions (vLLM: the last message prepended to the reply); completions have it
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")
    # Fields OpenAI's API declares nullable whose null means the default here (a non-None default):
    # `"n": null` or `"stream": null` is what some clients send for "not set".
    _NULL_MEANS_DEFAULT: ClassVar[frozenset[str]] = frozenset()
    # The fields refused unless at a harmless value (unknown_fields)
    _UNSUPPORTED: ClassVar[dict[str, tuple]] = _UNSUPPORTED_FIELDS

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls_meaning_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(data.get(name, 0) is None for name in cls._NULL_MEANS_DEFAULT):
            data = {name: value for name, value in data.items()
                    if not (value is None and name in cls._NULL_MEANS_DEFAULT)}
        return data

    def unknown_fields(self) -> list[str]:
        """Unknown fields a handler may ignore (with a warning); 400 for the ones that would change the output."""
        extra = self.model_extra or {}
        unsupported = self._UNSUPPORTED
        refused = sorted(name for name, value in extra.items()
                         if name in unsupported and value not in unsupported[name])
        if refused:
            raise invalid(refused[0], f"not supported by this server, which would ignore it; unsupported fields "
                          f"in this request: {', '.join(refused)} (remove them or leave them at their defaults)")
        return sorted(name for name in extra if name not in unsupported)


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(BaseModel):
    # Nullable, as vLLM's (Optional[bool]); include_usage left out with continuous_usage_stats true means
    # usage on, as vLLM's default include_usage=True gives
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _SamplingFields(_Body):
    """Fields shared by completions and chat completions."""

    _NULL_MEANS_DEFAULT = frozenset({"n", "stream", "presence_penalty", "frequency_penalty"})

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS_ENTRIES)
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: Count = 0
    priority: int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    stop_token_ids: list[Int64] | None = Field(default=None, max_length=MAX_TOKEN_ID_LIST)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1, le=INT64_MAX)  # -1: max_model_len (vLLM's)
    allowed_token_ids: list[Int64] | None = Field(default=None, max_length=MAX_TOKEN_ID_LIST)
    prompt_logprobs: Int64 | None = None
    # vLLM's: the prompt's prefix-cache blocks shared only with requests of the same salt (a non-empty string)
    cache_salt: str | None = None
    # vLLM's: the choices carry the generated token_ids, and the prompt's prompt_token_ids (streams: the first chunk)
    return_token_ids: bool | None = None
    bad_words: list[str] | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_json_object: bool | None = None
    structured_outputs: dict | None = None
    response_format: ResponseFormat | None = None
    use_beam_search: bool = False  # vLLM's: beam search with beam width n, the n beams as choices
    length_penalty: float = 1.0

    @property
    def include_usage(self) -> bool:
        options = self.stream_options
        if options is None:
            return False
        if options.include_usage is None:
            return options.continuous_usage_stats is True
        return options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM's stream_options.continuous_usage_stats: every chunk carries the running usage."""
        return self.include_usage and self.stream_options.continuous_usage_stats is True

    def check_stop(self) -> None:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stop) > MAX_STOP_STRINGS:
            raise invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in stop):
            raise invalid("stop", f"each stop string may have at most {MAX_STOP_STRING_CHARS} characters")

    def check_stream_options(self, max_logprobs: int) -> None:
        self.check_stop()
        if self.truncate_prompt_tokens == 0:
            raise invalid("truncate_prompt_tokens", "must be at least 1, or -1 for the model's max_model_len, got 0")
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise invalid("stream_options", "only allowed with stream=true")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise invalid("best_of", "cannot be larger than n when streaming")
        _check_logprobs("prompt_logprobs", self.prompt_logprobs, max_logprobs)
        if self.stream and self.use_beam_search:
            raise invalid("stream", "beam search (use_beam_search) returns whole beams, never a stream; "
                          "send stream=false")
        if self.stream and self.prompt_logprobs is not None:
            raise invalid("prompt_logprobs", "prompt logprobs are not available with stream=true")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
                        defaults: dict) -> SamplingParams:
        """Raises RequestError naming the field for a value out of range. `defaults`: the model's
        generation-config values (Engine.default_sampling_fields) of the fields the request leaves unset."""
        if self.use_beam_search:  # vLLM's beam search takes only the temperature of the model's defaults
            defaults = {"temperature": defaults.get("temperature", 0.0), "max_tokens": defaults.get("max_tokens")}
        optional = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
        }
        optional = {k: defaults.get(k) if v is None else v for k, v in optional.items()}
        if max_tokens is None:
            max_tokens = defaults.get("max_tokens")
        return SamplingParams(
            **{k: v for k, v in optional.items() if v is not None},
            n=self.n, best_of=self.best_of, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, max_tokens=max_tokens, min_tokens=self.min_tokens,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            truncate_prompt_tokens=self.truncate_prompt_tokens, logit_bias=_clamped(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words or None,
            guided_decoding=self.guided_decoding(), use_beam_search=self.use_beam_search,
            length_penalty=self.length_penalty,
        )

    def guided_decoding(self) -> GuidedDecodingParams | None:
        """The one output constraint the request sets (400 naming the field if several, or if invalid)."""
        given = {name: getattr(self, name) for name in ("guided_json", "guided_regex", "guided_choice",
                                                        "guided_grammar", "guided_json_object", "structured_outputs")}
        given = {name: value for name, value in given.items() if value not in (None, False)}
        if self.response_format is not None and self.response_format.type != "text":
            given["response_format"] = self.response_format
        if len(given) > 1:
            raise invalid(sorted(given)[1], f"give one output constraint, got {', '.join(sorted(given))}")
        if not given:
            return None
        (name, value), = given.items()
        return _guided_params(name, value)


def _clamped(logit_bias: dict[str, float] | None) -> dict[str, float] | None:
    """Biases beyond [-100, 100] clamped to it (OpenAI's range), as vLLM's server does; NaN left to be refused."""
    if logit_bias is None:
        return None
    return {token: value if value != value else min(MAX_ABS_LOGIT_BIAS, max(-MAX_ABS_LOGIT_BIAS, value))
            for token, value in logit_bias.items()}


def _check_response_format(response_format: ResponseFormat | None) -> None:
    if response_format is not None and response_format.type == "json_schema" and (
            response_format.json_schema is None or response_format.json_schema.schema_ is None):
        raise invalid("response_format.json_schema.schema", "is required with type 'json_schema'")


def _guided_params(name: str, value: Any) -> GuidedDecodingParams:
    """GuidedDecodingParams from one request field, compiled once here to check it (400 naming `name`)."""
    field = name
    try:
        if name == "response_format":
            if value.type == "json_object":
                params = GuidedDecodingParams(json_object=True)
            else:
                field = "response_format.json_schema.schema"
                # strict left out: strict, as vLLM compiles every schema (only an explicit false relaxes it)
                params = GuidedDecodingParams(json=value.json_schema.schema_, strict=value.json_schema.strict is not False)
        elif name == "structured_outputs":
            params = GuidedDecodingParams(**value)
        else:
            params = GuidedDecodingParams(**{name.removeprefix("guided_"): value})
        params.grammar_object()
    except (RequestError, TypeError) as e:
        raise invalid(field, str(e).removeprefix("SamplingParams.")) from None
    return params


PromptField = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingFields):
    _NULL_MEANS_DEFAULT = _SamplingFields._NULL_MEANS_DEFAULT | {"echo"}
    prompt: PromptField | None = None
    # vLLM's: base64 of torch.save(tensor [num_tokens, hidden_size]), or a list of them (enable_prompt_embeds)
    prompt_embeds: str | list[str] | None = None
    suffix: str | None = None
    max_tokens: Int64 | None = 16  # None (null): up to the model's context, as vLLM
    echo: bool = False
    logprobs: Int64 | None = None
    add_special_tokens: bool = True

    def check(self, max_logprobs: int = MAX_LOGPROBS) -> None:
        """`max_logprobs`: the engine's (most logprobs and prompt_logprobs a request may ask)."""
        if (self.prompt is None or self.prompt == "" or self.prompt == []) and not self.prompt_embeds:
            raise ApiError(400, EMPTY_PROMPT_MESSAGE, param="prompt")
        if self.prompt_embeds and self.echo:
            raise invalid("echo", "a prompt given as embeddings has no text or token ids to echo; drop echo")
        self.check_stream_options(max_logprobs)
        if self.suffix:
            raise invalid("suffix", "is not supported")
        _check_response_format(self.response_format)
        _check_logprobs("logprobs", self.logprobs, max_logprobs)
        if self.max_tokens is not None and self.max_tokens < 0:
            raise invalid("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.max_tokens == 0 and not self.echo:
            raise invalid("max_tokens", "must be at least 1 (0 is allowed only with echo=true)")

    @property
    def wants_prompt_only(self) -> bool:
        """echo with max_tokens=0: score the prompt, generate nothing (one token is generated and dropped)."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self, defaults: dict) -> SamplingParams:
        # echo + logprobs returns the prompt's logprobs too (lm-eval's loglikelihood).
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(self.logprobs, prompt_logprobs or 0)
        max_tokens = 1 if self.wants_prompt_only else self.max_tokens
        return self.sampling_params(max_tokens, self.logprobs, prompt_logprobs, defaults)


class ContentPart(_Body):
    type: str
    text: str | None = None
    refusal: str | None = None
    image_url: dict[str, Any] | str | None = None  # {"url": "data:image/png;base64,..."} (a vision model's)
    video_url: dict[str, Any] | str | None = None  # {"url": "data:video/mp4;base64,..."} (Qwen2-VL's, Qwen3-VL's)


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls, for the template
    tool_call_id: str | None = None  # a tool message's answer to one of them
    reasoning: str | None = None  # an assistant's earlier reasoning (vLLM passes it to the template)
    reasoning_content: str | None = None  # the same, by its older name

    def as_template_input(self, index: int) -> dict:
        """The message as the chat template reads it (a list of parts: `text_of_parts`; the rest as
        `tokenizer.apply_chat_template` prepares every message)."""
        content = self.content
        if isinstance(content, list) and any(part.type in (*CHAT_IMAGE_PARTS, CHAT_VIDEO_PART) for part in content):
            content = [part.model_dump(exclude_none=True) for part in content]  # runtime/multimodal.chat_images
        elif isinstance(content, list):
            try:
                content = text_of_parts([part.model_dump() for part in content])
            except ValueError as e:
                raise invalid(f"messages.{index}.content", str(e)) from None
        message = {"role": self.role, "content": content or ""}
        for name in ("name", "tool_calls", "tool_call_id", "reasoning", "reasoning_content"):
            if getattr(self, name) is not None:
                message[name] = getattr(self, name)
        thought = self.reasoning if self.reasoning is not None else self.reasoning_content
        if thought is not None:  # gpt-oss's template reads an assistant's analysis as `thinking`
            message["thinking"] = thought
        return message


class _ChatTemplateFields(BaseModel):
    """vLLM's options of the chat template's rendering (chat completions and /tokenize with messages)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def template_options(self) -> dict:
        return {"add_generation_prompt": self.add_generation_prompt, "continue_final_message": self.continue_final_message,
                "chat_template": self.chat_template, "chat_template_kwargs": self.chat_template_kwargs}


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields):
    _NULL_MEANS_DEFAULT = _SamplingFields._NULL_MEANS_DEFAULT | {"logprobs", "add_generation_prompt", "continue_final_message"}
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # false: the first tool call only (vLLM's reading of OpenAI's field)
    add_special_tokens: bool = False  # vLLM's: the tokenizer's special tokens on top of the template's

    def template_options(self) -> dict:
        # tools reach the template whatever tool_choice says, "none" too (vLLM's default)
        return super().template_options() | {"add_special_tokens": self.add_special_tokens,
                                             "tools": checked_tools(self.tools) or None}

    def check(self, max_logprobs: int = MAX_LOGPROBS) -> None:
        self.check_stream_options(max_logprobs)
        _check_response_format(self.response_format)
        self.tool_mode  # the tools and tool_choice checked
        _check_logprobs("top_logprobs", self.top_logprobs, max_logprobs)
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("top_logprobs", "needs logprobs=true")
        for name in ("max_tokens", "max_completion_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise invalid(name, f"must be at least 1, got {value}")

    def to_sampling_params(self, defaults: dict) -> SamplingParams:
        max_tokens = self.requested_max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(max_tokens, logprobs, self.prompt_logprobs, defaults)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def template_messages(self) -> list[dict]:
        return [m.as_template_input(i) for i, m in enumerate(self.messages)]

    @property
    def tool_mode(self) -> str | None:
        """How tools are used (400 naming the field for a bad tools or tool_choice): None (no tools), "none"
        (tools go to the template, the output is content), "auto" (the server's --tool-call-parser reads
        calls out of the output; vLLM's default when tools are given), "required" or "named" (the output
        is constrained to calls)."""
        tools = checked_tools(self.tools)
        choice = self.tool_choice
        if choice is None:
            mode = "auto" if tools else None
        elif choice in ("none", "auto", "required"):
            mode = choice
        elif isinstance(choice, dict):
            mode = "named"
            _checked_named_choice(choice)
        else:
            raise invalid("tool_choice", f"invalid value {choice!r}: only a named tool "
                          '({"type": "function", "function": {"name": NAME}}), "none", "auto" or "required" are supported')
        if mode in ("auto", "required", "named") and not tools:
            raise invalid("tool_choice", "when using `tool_choice`, `tools` must be set (a non-empty list)")
        if mode == "named" and self.named_tool is None:
            name = choice["function"]["name"]
            raise invalid("tool_choice.function.name", f"tool {name!r} has not been passed in `tools` "
                          f"(they are: {', '.join(t['function']['name'] for t in tools)})")
        if mode in ("required", "named") and self.use_beam_search:
            raise invalid("tool_choice", f'tool_choice {"required" if mode == "required" else "naming a function"} '
                          "constrains the output to tool calls, which beam search (use_beam_search) cannot do: "
                          'leave use_beam_search out, or send tool_choice "auto" or "none"')
        if mode in ("required", "named"):
            constraints = self._output_constraints()
            if constraints:
                raise invalid(constraints[0], f'tool_choice {"required" if mode == "required" else "naming a function"} '
                              "constrains the output to tool calls: you can only either use guided decoding "
                              f"(here {', '.join(constraints)}) or tools, not both")
        return mode

    @property
    def named_tool(self) -> tuple[int, dict] | None:
        """(index in tools, the tool's function) of a named tool_choice, if tools hold it."""
        choice = self.tool_choice
        if not isinstance(choice, dict) or not isinstance(choice.get("function"), dict):
            return None
        name = choice["function"].get("name")
        return next(((i, t["function"]) for i, t in enumerate(checked_tools(self.tools))
                     if t["function"]["name"] == name), None)

    def _output_constraints(self) -> list[str]:
        given = [name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_json_object",
                                   "structured_outputs") if getattr(self, name) not in (None, False)]
        if self.response_format is not None and self.response_format.type != "text":
            given.append("response_format")
        return sorted(given)

    def guided_decoding(self) -> GuidedDecodingParams | None:
        """A named or required tool_choice: the output is the function's arguments, or the array of calls."""
        mode = self.tool_mode
        if mode == "named":
            index, function = self.named_tool
            return _tool_parameters_guide(index, function)
        if mode == "required":
            return _required_guide(checked_tools(self.tools), single=self.parallel_tool_calls is False)
        return super().guided_decoding()


class TokenizeRequest(_Body, _ChatTemplateFields):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Any] | None = None  # vLLM's: tools the chat template renders with the messages
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise invalid("prompt", "give exactly one of prompt or messages")
        template_options = sorted(self.model_fields_set & (set(_ChatTemplateFields.model_fields) | {"tools"}))
        if self.prompt is not None and template_options:
            raise invalid(template_options[0], "applies to messages (the chat template), not to a prompt")
        checked_tools(self.tools)

    def template_options(self) -> dict:
        return super().template_options() | {"tools": checked_tools(self.tools) or None}


def checked_tools(tools: list | None) -> list[dict]:
    """The request's tools (runtime/tokenizer.checked_tools); 400 naming the malformed field."""
    try:
        return tokenizer_checked_tools(tools)
    except RequestError as e:
        raise ApiError(400, str(e), param=str(e).split(":", 1)[0]) from None


def _checked_named_choice(choice: dict) -> None:
    usage = 'correct usage: {"type": "function", "function": {"name": "my_function"}}'
    if choice.get("type", "function") != "function":
        raise invalid("tool_choice.type", f"must be 'function', got {choice.get('type')!r}; {usage}")
    function = choice.get("function")
    if not isinstance(function, dict):
        raise invalid("tool_choice.function", f"must be an object naming the function; {usage}")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise invalid("tool_choice.function.name", f"must be a non-empty string, got {name!r}; {usage}")


def _tool_parameters_guide(index: int, function: dict) -> GuidedDecodingParams:
    """The output constraint of a named tool_choice: the function's parameters schema (vLLM's), any JSON
    object for a function without one."""
    field = f"tools.{index}.function.parameters"
    try:
        if not function.get("parameters"):
            params = GuidedDecodingParams(json_object=True)
        else:
            params = GuidedDecodingParams(json=function["parameters"], strict=function.get("strict") is not False)
        params.grammar_object()
    except RequestError as e:
        raise invalid(field, str(e).removeprefix("SamplingParams.")) from None
    return params


def _required_guide(tools: list[dict], single: bool = False) -> GuidedDecodingParams:
    """tool_choice "required" (vLLM's construction): a JSON array of at least one {"name": <a tool's name>,
    "parameters": <its parameters>} object; the tools' `$defs` gathered at the top, where their "#/$defs/..."
    references point. `single` (parallel_tool_calls false): at most one (maxItems 1), so that the array
    closes after the call rather than running on to calls that would be dropped."""
    defs: dict = {}
    alternatives = []
    for index, tool in enumerate(tools):
        function = tool["function"]
        _tool_parameters_guide(index, function)  # a schema that cannot compile is named by its tool
        parameters, tool_defs = _parameters_in_array(index, function.get("parameters") or {"type": "object",
                                                                                          "properties": {}})
        for name, definition in tool_defs:
            if defs.setdefault(name, definition) != definition:
                raise invalid(f"tools.{index}.function.parameters.$defs.{name}", "another tool defines it differently; "
                              "with tool_choice required the tools' $defs share one namespace: rename one")
        alternatives.append({"properties": {"name": {"type": "string", "enum": [function["name"]]},
                                            "parameters": parameters},
                             "required": ["name", "parameters"]})
    schema: dict = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": alternatives}}
    if single:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    strict = all(tool["function"].get("strict") is not False for tool in tools)
    try:
        params = GuidedDecodingParams(json=schema, strict=strict)
        params.grammar_object()
    except RequestError as e:
        raise invalid("tools", f"tool_choice required: {str(e).removeprefix('SamplingParams.')}") from None
    return params


def _parameters_in_array(index: int, parameters: dict) -> tuple[dict, list[tuple[str, Any]]]:
    """A tool's parameters as they sit in tool_choice "required"'s array, and its definitions, to gather at
    the array's top. Definitions under "definitions" (pydantic v1's and zod-to-json-schema's name) join
    the `$defs`, their "#/definitions/NAME" references becoming "#/$defs/NAME"; a reference to anything
    else of the parameters ("#", "#/properties/...") cannot resolve inside the array: a 400 naming it."""
    where = f"tools.{index}.function.parameters"

    def moved(node: Any) -> Any:
        if isinstance(node, list):
            return [moved(item) for item in node]
        if not isinstance(node, dict):
            return node
        out = {key: moved(value) for key, value in node.items()}
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            if ref.startswith("#/definitions/"):
                out["$ref"] = "#/$defs/" + ref.removeprefix("#/definitions/")
            elif not ref.startswith("#/$defs/"):
                raise invalid(where, f'"$ref": {ref!r} cannot be resolved with tool_choice "required", where the '
                              "tools' parameters sit inside one array schema: only references to definitions "
                              '("#/$defs/NAME" or "#/definitions/NAME") do; move the referenced schema under $defs')
        return out

    parameters = dict(parameters)
    own = [(name, moved(definition)) for key in ("$defs", "definitions")
           for name, definition in (parameters.pop(key, None) or {}).items()]
    return moved(parameters), own


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class BatchRequestLine(BaseModel):
    """One line of an OpenAI batch input file."""

    model_config = ConfigDict(extra="ignore")
    custom_id: str
    method: Literal["POST"]
    url: Literal["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/classify", "/v1/score", "/v1/rerank"]
    body: dict


def openapi_body(model: type[BaseModel]) -> dict:
    """FastAPI's `openapi_extra` documenting `model` as the JSON request body (the handlers read the
    raw body to answer bad JSON in OpenAI's error shape, so FastAPI cannot infer it). Sub-models are
    inlined: the schema stands alone."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {key: inline(value) for key, value in node.items()}
        if isinstance(node, list):
            return [inline(value) for value in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


def _check_logprobs(name: str, value: int | None, max_logprobs: int) -> None:
    # -1 is "the whole vocabulary" (vLLM's): the engine checks it against max_logprobs
    if value is not None and value != -1 and not 0 <= value <= max_logprobs:
        raise invalid(name, f"must be between 0 and {max_logprobs} (this server's max_logprobs), got {value}")


# The deepest JSON nesting accepted (real requests nest about 5 deep).
MAX_JSON_DEPTH = 32


def parse_json_body(raw: bytes | str) -> object:
    """A request body (a server request, a batch file's line) as JSON: 400 for text that is not JSON,
    nesting deeper than MAX_JSON_DEPTH, or a string holding a lone UTF-16 surrogate."""
    try:
        body = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, and an integer of over 4300 digits
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    check_json_values(body)
    return body


def check_json_values(body: object) -> None:
    """400 for nesting deeper than MAX_JSON_DEPTH, or a string holding a lone surrogate ("\\ud800"
    is valid JSON but not Unicode text: it can be neither tokenized nor sent back)."""
    stack = [(body, 1, "body")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise ApiError(400, f"{path}: holds a lone UTF-16 surrogate, which is not valid Unicode text",
                               param=None if path == "body" else path)
            continue
        if not isinstance(value, (dict, list)):
            continue
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"the request body is nested too deeply (at most {MAX_JSON_DEPTH} levels)")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            child = str(key) if path == "body" else f"{path}.{key}"
            if isinstance(key, str) and _SURROGATE.search(key):
                raise ApiError(400, f"{child}: a key holds a lone UTF-16 surrogate, which is not valid Unicode text")
            if isinstance(item, (str, dict, list)):
                stack.append((item, depth + 1, child))


_SURROGATE = re.compile("[\ud800-\udfff]")


# ---- the Responses API (POST /v1/responses) ---------------------------------------------------

# Fields of OpenAI's Responses API that change what is generated and that llmc does not implement (background
# options, server-side truncation, conversations, stored prompts, built-in tool limits, ...), with their harmless values.
_UNSUPPORTED_RESPONSES_FIELDS: dict[str, tuple] = {
    "background_options": (None,), "truncation": (None, "disabled"),
    "conversation": (None,), "prompt": (None,), "max_tool_calls": (None,), "context_management": (None,),
    "moderation": (None,), "image": (None,), "prompt_cache_options": (None,),
}
# Chat completions fields a Responses request may carry by habit, which it does not read (ignored, they would
# leave the output unconstrained or unbounded without a word), with the Responses API's way to ask for the same.
_CHAT_FIELDS_IN_RESPONSES = {
    "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
    "response_format": 'text: {"format": ...}', "messages": "input (a list of message items)",
    "logprobs": 'include: ["message.output_text.logprobs"] (and top_logprobs)',
}
# The `include` value llmc produces (the output text's logprobs); OpenAI's others are about built-in tools,
# images or encrypted reasoning, which llmc does not have.
INCLUDE_LOGPROBS = "message.output_text.logprobs"
# vLLM's sampling extras (and chat template options) a Responses request may carry: they go to the chat
# request unchanged and are checked there, under the same names.
_RESPONSES_CHAT_EXTRAS = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                          "stop", "stop_token_ids", "min_tokens", "ignore_eos", "logit_bias", "priority",
                          "include_stop_str_in_output", "skip_special_tokens", "chat_template", "chat_template_kwargs")
# A chat request's field names in its errors → the Responses request's (the longest prefix first).
_CHAT_TO_RESPONSES_PARAMS = (
    (re.compile(r"^tools\.(\d+)\.function\."), r"tools.\1."),
    (re.compile(r"^tool_choice\.function\."), "tool_choice."),
    (re.compile(r"^response_format\.json_schema\."), "text.format."),
    (re.compile(r"^response_format\b"), "text.format"),
    (re.compile(r"^max_tokens\b"), "max_output_tokens"),
    (re.compile(r"^(messages|continue_final_message)\b[\w.]*"), "input"),
    (re.compile(r"^logprobs\b"), "include"),
)


class ResponsesRequest(_Body):
    """OpenAI's Responses API request, read as vLLM's server reads it: it becomes a chat completion
    request (`chat_body`) and is generated by the chat path. Built-in tools, truncation, conversations
    and stored prompts are refused (a 400 naming the field); `background` needs the response store
    (serving_responses checks it, and that it is not streamed)."""

    _NULL_MEANS_DEFAULT = frozenset({"stream", "tools", "tool_choice", "parallel_tool_calls", "store", "background"})
    _UNSUPPORTED = _UNSUPPORTED_RESPONSES_FIELDS

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[Any] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    top_logprobs: Int64 | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    service_tier: str | None = None  # OpenAI's billing tiers: one tier here
    # vLLM's extras, passed on to the chat request (checked there)
    seed: Any = None
    top_k: Any = None
    min_p: Any = None
    repetition_penalty: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    stop: Any = None
    stop_token_ids: Any = None
    min_tokens: Any = None
    ignore_eos: Any = None
    logit_bias: Any = None
    priority: Any = None
    include_stop_str_in_output: Any = None
    skip_special_tokens: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None

    def check(self) -> None:
        for name, instead in _CHAT_FIELDS_IN_RESPONSES.items():
            value = (self.model_extra or {}).get(name)
            if value is not None and value is not False:  # logprobs: false asks for nothing
                raise invalid(name, f"is a chat completions field, which the Responses API does not read; send {instead}")
        if self.input == "" or self.input == []:
            raise invalid("input", "must be a non-empty string or list of input items")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise invalid("max_output_tokens", f"must be at least 1, got {self.max_output_tokens}")
        for index, value in enumerate(self.include or []):
            if value != INCLUDE_LOGPROBS:
                raise invalid(f"include.{index}", f"{value!r} is not supported: this server has no built-in tools, "
                              f"images or encrypted reasoning; the only value it produces is {INCLUDE_LOGPROBS!r}")
        self.text_format()
        for index, tool in enumerate(self.tools):
            if not isinstance(tool, dict):
                raise invalid(f"tools.{index}", f"must be a function tool object, got {type(tool).__name__}")
            if tool.get("type") != "function":
                raise invalid(f"tools.{index}.type", f"{tool.get('type')!r} is not supported: only function tools "
                              '({"type": "function", "name", "parameters"}), no built-in tools (web_search, '
                              "file_search, code_interpreter, mcp, ...)")
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") != "function":
            raise invalid("tool_choice.type", f"{choice.get('type')!r} is not supported: send \"none\", \"auto\", "
                          '"required" or {"type": "function", "name": NAME}')
        if isinstance(choice, dict) and not (isinstance(choice.get("name"), str) and choice["name"]):
            # here, not in the chat request's check, whose hint is chat's shape ({"function": {"name"}})
            raise invalid("tool_choice.name", f"must be a non-empty string, got {choice.get('name')!r}; send "
                          '{"type": "function", "name": NAME}')
        if not (choice in ("none", "auto", "required") or isinstance(choice, dict)):
            raise invalid("tool_choice", f'must be "none", "auto", "required" or {{"type": "function", "name": NAME}}, '
                          f"got {choice!r}")
        verbosity = (self.text or {}).get("verbosity")
        if verbosity not in (None, "medium"):
            raise invalid("text.verbosity", f"{verbosity!r} is not supported (the model writes as it does); leave it out")
        self.input_items()  # every item checked

    def text_format(self) -> dict | None:
        """The chat request's response_format for text.format (None for plain text)."""
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            kind = fmt.get("type") if isinstance(fmt, dict) else fmt
            raise invalid("text.format.type", f'must be "text", "json_object" or "json_schema", got {kind!r}')
        if fmt["type"] == "text":
            return None
        if fmt["type"] == "json_object":
            return {"type": "json_object"}
        if not isinstance(fmt.get("schema"), dict):
            raise invalid("text.format.schema", "is required with type 'json_schema' (a JSON Schema object)")
        if not (isinstance(fmt.get("name"), str) and fmt["name"]):  # OpenAI's (and the echoed format's) required name
            raise invalid("text.format.name", "is required with type 'json_schema' (a non-empty string naming the format)")
        return {"type": "json_schema", "json_schema": {key: fmt[key] for key in ("name", "description", "schema", "strict")
                                                       if fmt.get(key) is not None}}

    def input_items(self) -> list[dict]:
        """`input` as a list of items (a string is one user message), each checked (400 naming it)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [_checked_item(index, item) for index, item in enumerate(self.input)]

    @property
    def wants_logprobs(self) -> bool:
        return INCLUDE_LOGPROBS in (self.include or [])

    def chat_body(self, history: list[dict], stream: bool) -> dict:
        """The chat completion request this request is: `instructions` as the first (system) message, then
        `history` (the items of a previous response, input and output) and `input` as chat messages; the
        function tools in chat's shape; text.format as response_format; max_output_tokens as max_tokens."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        messages += items_to_messages(history + self.input_items())
        body: dict[str, Any] = {"messages": messages, "stream": stream, "parallel_tool_calls": self.parallel_tool_calls}
        if self.model is not None:
            body["model"] = self.model
        for name in ("temperature", "top_p", "user", *_RESPONSES_CHAT_EXTRAS):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        if self.tools:
            body["tools"] = [{"type": "function", "function": {key: tool[key] for key in
                              ("name", "description", "parameters", "strict") if key in tool}} for tool in self.tools]
        choice = self.tool_choice
        if isinstance(choice, dict):
            body["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif self.tools or choice == "required":  # "auto" / "none" without tools: nothing to choose from (OpenAI's)
            body["tool_choice"] = choice
        response_format = self.text_format()
        if response_format is not None:
            body["response_format"] = response_format
        if self.wants_logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = self.top_logprobs or 0
        return body

    def echoed_tools(self) -> list[dict]:
        return [{"type": "function", "name": tool.get("name"), "description": tool.get("description"),
                 "parameters": tool.get("parameters"), "strict": tool.get("strict")} for tool in self.tools]


def responses_error(error: ApiError) -> ApiError:
    """A chat request's 400 in the Responses request's field names (max_tokens → max_output_tokens, ...)."""
    if error.param is None:
        return error
    for pattern, replacement in _CHAT_TO_RESPONSES_PARAMS:
        param = pattern.sub(replacement, error.param, count=1)
        if param != error.param:
            message = error.message
            if error.code == "context_length_exceeded":  # its advice names the fields too
                message = message.replace(" the messages", " the input").replace("(max_tokens at", "(max_output_tokens at")
            if message.startswith(error.param):
                message = param + message[len(error.param):]
            return ApiError(error.status_code, message, param=param, code=error.code, headers=error.headers)
    return error


_INPUT_ROLES = ("user", "system", "developer", "assistant")



def _check_text_or_parts(value, param: str) -> None:
    """A message's content or a tool result's output: a string, or a list of input_text parts."""
    if isinstance(value, list):
        try:
            text_of_parts(value)
        except (ValueError, AttributeError) as e:
            raise invalid(param, str(e)) from None
    elif not isinstance(value, str):
        raise invalid(param, "must be a string or a list of input_text parts")

def _checked_item(index: int, item: Any) -> dict:
    """One input item, checked: a message (with or without "type": "message"), a function_call, a
    function_call_output or a reasoning item (OpenAI's shapes); 400 naming the field otherwise."""
    where = f"input.{index}"
    if not isinstance(item, dict):
        raise invalid(where, f"must be an input item object, got {type(item).__name__}")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        if item.get("role") not in _INPUT_ROLES:
            raise invalid(f"{where}.role", f"must be one of {', '.join(_INPUT_ROLES)}, got {item.get('role')!r}")
        _check_text_or_parts(item.get("content"), f"{where}.content")
        return {**item, "type": "message"}
    if kind == "function_call":
        for field in ("call_id", "name", "arguments"):
            if not isinstance(item.get(field), str):
                raise invalid(f"{where}.{field}", "is required (a string) in a function_call item")
        try:
            json.loads(item["arguments"] or "{}")
        except ValueError:
            raise invalid(f"{where}.arguments", f"not JSON text ({item['arguments'][:40]!r}); send the arguments "
                          "as a JSON object's text, as the call gave them") from None
        return item
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise invalid(f"{where}.call_id", "is required (a string): the call_id of the function_call it answers")
        _check_text_or_parts(item.get("output"), f"{where}.output")
        return item
    if kind == "reasoning":
        if item.get("encrypted_content") is not None:
            raise invalid(f"{where}.encrypted_content", "encrypted reasoning is not supported: send the reasoning "
                          "item as this server returned it (its content)")
        return item
    raise invalid(f"{where}.type", f"{kind!r} is not supported: input items are messages, function_call, "
                  "function_call_output and reasoning items (no item references or built-in tool calls)")


def _item_text(parts: str | list) -> str:
    return parts if isinstance(parts, str) else text_of_parts(parts)


def _reasoning_text(item: dict) -> str:
    """A reasoning item's text: its reasoning_text content, else its summary's text."""
    parts = item.get("content") or item.get("summary") or []
    return "\n".join(part.get("text") or "" for part in parts if isinstance(part, dict))


def items_to_messages(items: list[dict]) -> list[dict]:
    """Checked input items as chat messages, as the chat template reads them: a message keeps its role and
    its parts' text; a function_call_output is a tool message (tool_call_id = its call_id); the items of
    one assistant turn (a reasoning item, then the assistant's message, then its function_calls, in that
    order, as a Response's output lists them) become one assistant message with reasoning, content and
    tool_calls (id = call_id), the shape of the chat reply they stand for."""
    messages: list[dict] = []
    turn: dict | None = None  # the assistant message being gathered

    def assistant() -> dict:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": None}
            messages.append(turn)
        return turn

    for item in items:
        kind = item["type"]
        if kind == "reasoning":
            if turn is not None and (turn.get("content") is not None or "tool_calls" in turn or "reasoning" in turn):
                turn = None
            assistant()["reasoning"] = _reasoning_text(item)
        elif kind == "message" and item["role"] == "assistant":
            if turn is not None and (turn.get("content") is not None or "tool_calls" in turn):
                turn = None
            assistant()["content"] = _item_text(item["content"])
        elif kind == "function_call":
            assistant().setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
        else:
            turn = None
            if kind == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _item_text(item["output"])})
            else:
                messages.append({"role": item["role"], "content": _item_text(item["content"])})
    return messages


# vLLM's embedding fields that change the output and that llmc does not implement: a 400 unless at these values
_UNSUPPORTED_EMBEDDING_FIELDS: dict[str, tuple] = {
    "mm_processor_kwargs": (None,), "softmax": (None,), "activation": (None,),
    "embed_dtype": (None, "float32"), "endianness": (None, "native", "little"),
}


class _PoolingInput(_Body, _ChatTemplateFields):
    """What every pooling request of one or more prompts takes (vLLM's PoolingBasicRequestMixin and its chat
    and completion forms): `input` (a text, texts, token ids or lists of them) or the chat form, `messages`
    rendered with the chat template (add_generation_prompt off by default)."""

    _UNSUPPORTED = _UNSUPPORTED_EMBEDDING_FIELDS
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    add_special_tokens: bool | None = None  # default: true for input, false for messages (vLLM's)
    add_generation_prompt: bool = False  # vLLM's EmbeddingChatRequest default
    priority: Int64 = 0

    def check(self) -> None:
        if (self.input is None) == (self.messages is None):
            raise invalid("input", "give exactly one of input or messages")
        if self.truncate_prompt_tokens == 0:
            raise invalid("truncate_prompt_tokens", "must be -1 (max_model_len) or at least 1")
        template_options = sorted(self.model_fields_set & set(_ChatTemplateFields.model_fields))
        if self.input is not None and template_options:
            raise invalid(template_options[0], "applies to messages (the chat template), not to input")

    def template_options(self) -> dict:
        return super().template_options() | {"add_special_tokens": bool(self.add_special_tokens)}


class EmbeddingRequest(_PoolingInput):
    """POST /v1/embeddings (OpenAI's, with vLLM's extras), on an embedding model."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    normalize: bool | None = None
    use_activation: bool | None = None  # vLLM's newer name for normalize


class ClassificationRequest(_PoolingInput):
    """POST /classify and /v1/classify (vLLM's), on a sequence classifier: each input's class probabilities
    (use_activation false: its raw logits) and most likely label."""

    use_activation: bool | None = None


class PoolingRequest(EmbeddingRequest):
    """POST /pooling (vLLM's): an embedding or classification request; its `task` (vLLM's pooling task), when
    given, must be the model's ("embed" or "classify") or its token-level form ("token_embed", "token_classify")."""

    task: str | None = None

    def check(self) -> None:
        super().check()
        if self.task not in (None, *REQUEST_TASKS):
            raise invalid("task", f"{self.task!r}: this server's pooling engine runs {', '.join(REQUEST_TASKS)}")


# a score's activation is the classifier's (vLLM's use_activation false, raw logits, is not taken)
_UNSUPPORTED_SCORE_FIELDS: dict[str, tuple] = {"use_activation": (None, True), "activation": (None, True),
                                               "mm_processor_kwargs": (None,)}


class ScoreRequest(_Body):
    """POST /score and /v1/score (vLLM's): on an embedding model the cosine similarity of text_1's and text_2's
    embeddings, on a cross-encoder (a classifier of one label) its score of the pair; one text_1 against each
    text_2, or pairs of equal-length lists."""

    _UNSUPPORTED = _UNSUPPORTED_SCORE_FIELDS

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    priority: Int64 = 0


class RerankRequest(_Body):
    """POST /rerank, /v1/rerank, /v2/rerank (vLLM's, the Jina / Cohere form): the documents ordered by their score
    against the query (ScoreRequest's), the top_n first."""

    _UNSUPPORTED = _UNSUPPORTED_SCORE_FIELDS

    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = Field(default=None, ge=0)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    priority: Int64 = 0
